//! A NETLINK_NETFILTER socket that sends one batch and checks every acknowledgement.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use netns::netlink::messages;

use super::msg::Batch;
use super::NftError;

const RCVBUF: libc::c_int = 1 << 20;
/// Errnos by which the kernel says an expression, chain type or family is not available.
const MISSING_FEATURE_ERRNOS: [i32; 3] = [libc::ENOENT, libc::EOPNOTSUPP, libc::EAFNOSUPPORT];

fn sock_err(what: &'static str) -> impl FnOnce(io::Error) -> NftError {
    move |source| NftError::Socket { what, source }
}

fn check(ret: libc::c_int, what: &'static str) -> Result<libc::c_int, NftError> {
    if ret < 0 {
        Err(sock_err(what)(io::Error::last_os_error()))
    } else {
        Ok(ret)
    }
}

/// Opens a netfilter netlink socket in the calling thread's netns (closed on drop), with the receive timeout
/// every netlink socket of ours has ([`netns::netlink::RECV_TIMEOUT`]).
pub(crate) fn open() -> Result<OwnedFd, NftError> {
    let fd = netns::netlink::socket(libc::NETLINK_NETFILTER).map_err(sock_err("open NETLINK_NETFILTER socket"))?;
    let one: libc::c_int = 1;
    for (level, name, value, what) in [
        (libc::SOL_NETLINK, libc::NETLINK_CAP_ACK, one, "set NETLINK_CAP_ACK"),
        (libc::SOL_SOCKET, libc::SO_RCVBUF, RCVBUF, "set SO_RCVBUF"),
    ] {
        // SAFETY: `value` outlives the call and the length matches its type.
        let ret = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        check(ret, what)?;
    }
    Ok(fd)
}

/// Sends `batch` and reads the kernel's answers. nfnetlink processes a batch synchronously inside sendmsg, so
/// every answer is queued when send returns; anything but one zero ack per object is an error, and the first
/// failing object (by sequence) is reported, because later failures usually follow from it.
pub(super) fn commit(batch: &Batch) -> Result<(), NftError> {
    commit_on(open()?.as_fd(), batch)
}

/// [`commit`] on an open socket whose earlier exchanges were read to the end.
pub(super) fn commit_on(fd: BorrowedFd<'_>, batch: &Batch) -> Result<(), NftError> {
    let bytes = batch.writer.bytes();
    // SAFETY: `bytes` is a valid buffer of the given length; the kernel is the default destination.
    let sent = unsafe { libc::send(fd.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), 0) };
    if check(sent as libc::c_int, "send batch")? as usize != bytes.len() {
        return Err(sock_err("send batch")(io::Error::new(io::ErrorKind::WriteZero, "short send")));
    }

    let mut answers: Vec<Option<i32>> = vec![None; batch.objects.len()];
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::WouldBlock {
                break;
            }
            return Err(sock_err("receive acknowledgements")(err));
        }
        if n == 0 {
            break;
        }
        parse_answers(&buf[..n as usize], batch.first_seq, &mut answers);
    }

    let failed = answers.iter().enumerate().find_map(|(i, a)| a.filter(|e| *e != 0).map(|e| (i, e)));
    if let Some((index, errno)) = failed {
        return Err(kernel_error(&batch.objects[index], errno));
    }
    match answers.iter().position(Option::is_none) {
        Some(index) => Err(NftError::MissingAck { object: batch.objects[index].name.clone() }),
        None => Ok(()),
    }
}

/// Records the errno (0 for an ack) of every NLMSG_ERROR in `data` against its sequence number.
fn parse_answers(data: &[u8], first_seq: u32, answers: &mut [Option<i32>]) {
    for message in messages(data) {
        let Some(errno) = message.errno() else { continue };
        if let Some(slot) = message.seq.checked_sub(first_seq).and_then(|i| answers.get_mut(i as usize)) {
            // Keep the first error if the kernel reports a message twice.
            if slot.is_none_or(|e| e == 0) {
                *slot = Some(errno);
            }
        }
    }
}

/// A kernel errno for `object`: a missing feature when the errno says so and the object needs one.
pub(super) fn kernel_error(object: &super::msg::Object, errno: i32) -> NftError {
    let source = io::Error::from_raw_os_error(errno);
    if MISSING_FEATURE_ERRNOS.contains(&errno) && !object.features.is_empty() {
        return NftError::MissingFeature { feature: object.features.join(", "), object: object.name.clone(), source };
    }
    NftError::Rejected { object: object.name.clone(), source }
}

#[cfg(test)]
mod tests {
    use super::super::msg::Object;
    use super::*;

    fn object(features: Vec<&'static str>) -> Object {
        let port = istio_contract::ports::INBOUND_PLAINTEXT;
        Object { name: format!("rule 0 of inet istio-proxy-mangle istio-tproxy (tproxy ip to :{port})"), features }
    }

    #[test]
    fn missing_module_names_the_feature() {
        let err = kernel_error(&object(vec!["tproxy expression (nft_tproxy)"]), libc::ENOENT);
        assert!(matches!(err, NftError::MissingFeature { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("nft_tproxy") && text.contains("istio-tproxy"), "{text}");
    }

    #[test]
    fn other_errnos_and_core_objects_are_rejections() {
        assert!(matches!(kernel_error(&object(vec!["x"]), libc::EINVAL), NftError::Rejected { .. }));
        assert!(matches!(kernel_error(&object(Vec::new()), libc::ENOENT), NftError::Rejected { .. }));
    }

    #[test]
    fn acks_and_errors_are_matched_by_sequence() {
        let mut data = Vec::new();
        for (seq, code) in [(5u32, 0i32), (6, -libc::ELOOP)] {
            data.extend_from_slice(&20u32.to_ne_bytes());
            data.extend_from_slice(&netns::netlink::uapi::NLMSG_ERROR.to_ne_bytes());
            data.extend_from_slice(&0u16.to_ne_bytes());
            data.extend_from_slice(&seq.to_ne_bytes());
            data.extend_from_slice(&0u32.to_ne_bytes());
            data.extend_from_slice(&code.to_ne_bytes());
        }
        let mut answers = vec![None; 3];
        parse_answers(&data, 5, &mut answers);
        assert_eq!(answers, vec![Some(0), Some(libc::ELOOP), None]);

        // An unaligned last message without its padding, or a length past the datagram, ends the walk.
        let mut tail = data[..20].to_vec();
        tail.push(0);
        tail[0] = 21;
        let mut answers = vec![None; 3];
        parse_answers(&tail, 5, &mut answers);
        assert_eq!(answers, vec![Some(0), None, None]);
        data[20] = 200;
        let mut answers = vec![None; 3];
        parse_answers(&data, 5, &mut answers);
        assert_eq!(answers, vec![Some(0), None, None]);
    }
}
