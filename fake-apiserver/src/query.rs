//! Query-string parsing with the decoding Go's `url.ParseQuery` applies (`+` is a space, `%XX` escapes).

/// Decoded query parameters in request order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Query(Vec<(String, String)>);

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Query {
    pub fn parse(raw: &str) -> Query {
        Query(
            raw.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    (decode(k), decode(v))
                })
                .collect(),
        )
    }

    /// The first value of `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// Whether boolean parameter `name` is set to `true` or `1`.
    pub fn flag(&self, name: &str) -> bool {
        matches!(self.get(name), Some("true" | "1"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_selectors() {
        let q =
            Query::parse("labelSelector=app%20in%20%28a%2Cb%29&fieldSelector=spec.nodeName%3Dn1&watch=1&x=a+b&bad=%zz");
        assert_eq!(q.get("labelSelector"), Some("app in (a,b)"));
        assert_eq!(q.get("fieldSelector"), Some("spec.nodeName=n1"));
        assert!(q.flag("watch"));
        assert!(!q.flag("missing"));
        assert_eq!(q.get("x"), Some("a b"));
        assert_eq!(q.get("bad"), Some("%zz"));
        assert_eq!(Query::parse("t=%4").get("t"), Some("%4"));
    }
}
