//! Id remapping: the queries sent on one upstream socket or connection and not answered yet, by the id they were
//! sent with.
//!
//! Guarantees:
//! - Each query goes upstream under a random id (keyed per socket, so it cannot be predicted) that no other
//!   pending query on that socket has; nothing but the id is changed.
//! - An answer is handed to a query only when it is a response, carries that query's pending id and echoes its
//!   question ([`wire::echoes`]); it goes back with the client's own id. Anything else (a late answer to a query
//!   that gave up, a second answer, a stray or forged message) is dropped.
//! - A query that stops waiting (answered, failed, timed out) is forgotten at once, and never takes a later
//!   query's registration with it, so the table holds at most the pod's in-flight queries.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use super::wire;

/// The queries sent on one upstream socket or connection and not answered yet, by the id they were sent with.
/// Its size is bounded by the in-flight slots of the pod that sends on it.
#[derive(Debug)]
pub(super) struct Pending {
    state: Mutex<PendingState>,
    /// Keys the id choice, so the ids sent upstream cannot be predicted.
    ids: RandomState,
}

#[derive(Debug, Default)]
struct PendingState {
    waiters: HashMap<u16, Waiter>,
    /// Set when the connection is gone: nothing more is registered.
    closed: bool,
    /// Registrations so far: tells a registration from a later one that reused its id.
    registered: u64,
}

#[derive(Debug)]
struct Waiter {
    registration: u64,
    /// The id the client chose, put back into the answer.
    client_id: u16,
    /// The query's question section, which the answer must echo (unchecked when empty: it did not parse).
    question: Box<[u8]>,
    answer: oneshot::Sender<Vec<u8>>,
}

impl Pending {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Pending { state: Mutex::default(), ids: RandomState::new() })
    }

    fn lock(&self) -> MutexGuard<'_, PendingState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers `query` under a random id no other pending query has. Returns the query as it is to be sent
    /// (with that id) and the registration; `None` once the connection is closed, or for a query shorter than a
    /// header (the forwarder admits none).
    pub(super) fn register(self: &Arc<Self>, query: &[u8]) -> Option<(Vec<u8>, Waiting)> {
        let client_id = wire::id_of(query)?;
        let mut state = self.lock();
        if state.closed || state.waiters.len() > usize::from(u16::MAX) {
            return None;
        }
        let registration = state.registered;
        state.registered += 1;
        // Few of the 65536 ids are taken (a pod's in-flight slots bound them), so a probe or two finds a free one.
        let id = (0u64..)
            .map(|probe| self.ids.hash_one((registration, probe)) as u16)
            .find(|id| !state.waiters.contains_key(id))?;
        let (answer, receiver) = oneshot::channel();
        let waiter = Waiter { registration, client_id, question: wire::question_of(query).into(), answer };
        state.waiters.insert(id, waiter);
        let mut sent = query.to_vec();
        wire::set_id(&mut sent, id);
        Some((sent, Waiting { pending: self.clone(), id, registration, answer: receiver }))
    }

    /// Hands `answer` to the query it answers: the one pending under its id, when it echoes that query's question
    /// (or has none, as some error answers do). Anything else (a late answer to a query that gave up, a stray or
    /// forged message) is dropped.
    pub(super) fn deliver(&self, mut answer: Vec<u8>) {
        if !wire::is_response(&answer) {
            return;
        }
        let Some(id) = wire::id_of(&answer) else { return };
        let waiter = {
            let mut state = self.lock();
            let Some(waiter) = state.waiters.get(&id) else { return };
            if !wire::echoes(&answer, &waiter.question) {
                return;
            }
            state.waiters.remove(&id)
        };
        if let Some(waiter) = waiter {
            wire::set_id(&mut answer, waiter.client_id);
            let _ = waiter.answer.send(answer);
        }
    }

    /// Fails every pending query: their exchanges return an error at once (the upstream refused them).
    pub(super) fn fail_all(&self) {
        self.lock().waiters.clear();
    }

    /// Fails every pending query and registers no more: the connection is gone.
    pub(super) fn close(&self) {
        let mut state = self.lock();
        state.closed = true;
        state.waiters.clear();
    }

    pub(super) fn is_closed(&self) -> bool {
        self.lock().closed
    }
}

/// A query waiting for its answer; unregisters it when dropped (answered, failed, or given up on at a timeout).
#[derive(Debug)]
pub(super) struct Waiting {
    pending: Arc<Pending>,
    id: u16,
    registration: u64,
    answer: oneshot::Receiver<Vec<u8>>,
}

impl Waiting {
    /// The answer, with the client's id; an error when the socket or connection failed first.
    pub(super) async fn answer(&mut self) -> io::Result<Vec<u8>> {
        (&mut self.answer).await.map_err(|_| io::Error::new(io::ErrorKind::ConnectionAborted, "upstream failed"))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut state = self.pending.lock();
        if state.waiters.get(&self.id).is_some_and(|w| w.registration == self.registration) {
            state.waiters.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::wire::{FLAG_QR, HEADER_LEN};
    use super::*;

    /// A query for `example.com. A` with id 0xbeef, RD and CD set, and an EDNS OPT record.
    fn query() -> Vec<u8> {
        let mut q = vec![0xbe, 0xef, 0x01, 0x10, 0, 1, 0, 0, 0, 0, 0, 1];
        q.extend_from_slice(b"\x07example\x03com\x00\x00\x01\x00\x01");
        q.extend_from_slice(&[0, 0, 41, 0x04, 0xd0, 0, 0, 0, 0, 0, 0]);
        q
    }

    /// An answer to `query` (its question echoed, id `id`) with one A record whose data is `rdata_len` bytes.
    fn answer_to(query: &[u8], id: u16, rdata_len: u16) -> Vec<u8> {
        let mut a = id.to_be_bytes().to_vec();
        a.extend_from_slice(&[0x81, 0x80, 0, 1, 0, 1, 0, 0, 0, 0]);
        a.extend_from_slice(wire::question_of(query));
        a.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60]);
        a.extend_from_slice(&rdata_len.to_be_bytes());
        a.extend(std::iter::repeat_n(7, usize::from(rdata_len)));
        a
    }

    fn id_of(message: &[u8]) -> u16 {
        wire::id_of(message).expect("a full header")
    }

    #[test]
    fn pending_queries_get_distinct_ids_and_their_answers_with_the_clients_id() {
        let pending = Pending::new();
        let q = query();
        let (sent_a, mut a) = pending.register(&q).expect("registered");
        let (sent_b, mut b) = pending.register(&q).expect("registered");
        assert_ne!(id_of(&sent_a), id_of(&sent_b), "two queries with the same client id are told apart");
        assert_eq!(sent_a[2..], q[2..], "only the id is changed");
        pending.deliver(answer_to(&q, id_of(&sent_b), 4));
        let answer = b.answer.try_recv().expect("b answered");
        assert_eq!(answer, answer_to(&q, 0xbeef, 4), "with the client's id back");
        assert!(a.answer.try_recv().is_err(), "a still waits");
        pending.deliver(answer_to(&q, id_of(&sent_b), 4));
        assert!(a.answer.try_recv().is_err(), "a second answer to b goes nowhere");
        drop(b);
        assert_eq!(pending.lock().waiters.len(), 1);
        drop(a);
        assert!(pending.lock().waiters.is_empty(), "a query that gives up is forgotten");
    }

    #[test]
    fn an_answer_must_echo_the_question_and_be_a_response() {
        let pending = Pending::new();
        let q = query();
        let (sent, mut waiting) = pending.register(&q).expect("registered");
        let mut other = answer_to(&q, id_of(&sent), 4);
        other[HEADER_LEN + 1] = b'X'; // another name
        pending.deliver(other);
        let mut not_a_response = answer_to(&q, id_of(&sent), 4);
        not_a_response[2] &= !FLAG_QR;
        pending.deliver(not_a_response);
        assert!(waiting.answer.try_recv().is_err(), "neither is taken as the answer");
        let mut upper = answer_to(&q, id_of(&sent), 4);
        upper[HEADER_LEN + 1..HEADER_LEN + 8].make_ascii_uppercase();
        pending.deliver(upper);
        assert!(waiting.answer.try_recv().is_ok(), "names compare case-insensitively");
    }

    #[test]
    fn failing_or_closing_ends_every_wait() {
        let pending = Pending::new();
        let (_, mut a) = pending.register(&query()).expect("registered");
        pending.fail_all();
        assert!(a.answer.try_recv().is_err_and(|e| e == oneshot::error::TryRecvError::Closed));
        assert!(pending.register(&query()).is_some(), "a UDP socket takes queries after a failure");
        pending.close();
        assert!(pending.register(&query()).is_none(), "a closed connection takes none");
    }

    #[test]
    fn a_late_waiter_does_not_unregister_a_later_query_with_its_id() {
        let pending = Pending::new();
        let (sent, first) = pending.register(&query()).expect("registered");
        let id = id_of(&sent);
        // Answered: the waiter is gone from the table, but `first` is not dropped yet.
        pending.deliver(answer_to(&query(), id, 4));
        let later = Waiter { registration: 99, client_id: 1, question: Box::default(), answer: oneshot::channel().0 };
        pending.lock().waiters.insert(id, later);
        drop(first);
        assert!(pending.lock().waiters.contains_key(&id), "the later registration stays");
    }

    #[test]
    fn a_query_shorter_than_a_header_is_not_registered() {
        assert!(Pending::new().register(&[0xbe, 0xef, 1]).is_none());
    }
}
