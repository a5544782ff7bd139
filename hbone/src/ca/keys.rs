//! Reading CA private keys in the encodings Istio's `cacerts` secrets use (PKCS#8, PKCS#1 RSA, SEC1 EC).
//!
//! rcgen with the ring backend only takes PKCS#8, so PKCS#1 and SEC1 keys are wrapped into PKCS#8 here.

use rcgen::KeyPair;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};

/// DER of `rsaEncryption` AlgorithmIdentifier (OID 1.2.840.113549.1.1.1 with NULL parameters).
const RSA_ALGORITHM: &[u8] =
    &[0x30, 0x0d, 0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01, 0x05, 0x00];
/// DER of the `id-ecPublicKey` OID (1.2.840.10045.2.1).
const EC_PUBLIC_KEY_OID: &[u8] = &[0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];
/// DER of the named-curve OIDs ring can sign with: prime256v1 and secp384r1.
const EC_CURVE_OIDS: [&[u8]; 2] =
    [&[0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07], &[0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x22]];

/// Parses a PEM private key into an rcgen key pair, or says why it cannot.
pub(crate) fn key_pair_from_pem(pem: &[u8]) -> Result<KeyPair, String> {
    let key = PrivateKeyDer::from_pem_slice(pem).map_err(|e| format!("no private key: {e}"))?;
    let candidates: Vec<Vec<u8>> = match &key {
        PrivateKeyDer::Pkcs8(k) => vec![k.secret_pkcs8_der().to_vec()],
        PrivateKeyDer::Pkcs1(k) => vec![pkcs8(RSA_ALGORITHM, k.secret_pkcs1_der())],
        PrivateKeyDer::Sec1(k) => EC_CURVE_OIDS
            .iter()
            .map(|curve| {
                let algorithm = der(0x30, &[EC_PUBLIC_KEY_OID, curve].concat());
                pkcs8(&algorithm, k.secret_sec1_der())
            })
            .collect(),
        _ => return Err("unsupported private key encoding".to_string()),
    };
    let mut last = String::from("no key candidates");
    for der in candidates {
        match KeyPair::try_from(&PrivatePkcs8KeyDer::from(der)) {
            Ok(pair) => return Ok(pair),
            Err(e) => last = e.to_string(),
        }
    }
    Err(last)
}

/// Wraps a raw private key into a PKCS#8 `PrivateKeyInfo` with the given AlgorithmIdentifier.
fn pkcs8(algorithm: &[u8], raw: &[u8]) -> Vec<u8> {
    let version = [0x02, 0x01, 0x00];
    der(0x30, &[&version[..], algorithm, &der(0x04, raw)].concat())
}

/// Encodes one DER TLV with a definite length.
fn der(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let len = content.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes = len.to_be_bytes();
        let skip = bytes.iter().take_while(|b| **b == 0).count();
        out.push(0x80 | (bytes.len() - skip) as u8);
        out.extend_from_slice(&bytes[skip..]);
    }
    out.extend_from_slice(content);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    #[test]
    fn reads_sec1_ec_keys_by_wrapping_them() {
        let pair = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let pkcs8_der = pair.serialize_der();
        // A PKCS#8 EC key holds the SEC1 ECPrivateKey in its final OCTET STRING; pull it out.
        let info = x509_parser::der_parser::parse_der(&pkcs8_der).unwrap().1;
        let items = info.as_sequence().unwrap();
        let sec1 = items[2].as_slice().unwrap();
        let sec1_pem = format!(
            "-----BEGIN EC PRIVATE KEY-----\n{}\n-----END EC PRIVATE KEY-----\n",
            base64::engine::general_purpose::STANDARD.encode(sec1)
        );
        let back = key_pair_from_pem(sec1_pem.as_bytes()).unwrap();
        assert_eq!(back.public_key_raw(), pair.public_key_raw());
    }
}
