//! The crate's one error type, and its one conversion into `tonic::Status` (and back, for clients).

use prost::Message;
use rsrun_proto::v1 as pb;
use tonic::{Code, Status};

/// Everything that can go wrong in the rendezvous service or its client.
///
/// Messages are lowercase, carry the offending value, and say what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RdzvError {
    /// A request field is malformed or out of range.
    #[error("invalid {field}: {message}")]
    InvalidArgument {
        /// Which field (e.g. `job_id`).
        field: &'static str,
        /// What is wrong with it, including the value.
        message: String,
    },
    /// The job does not exist (never joined, or removed after its retention time).
    #[error("job {job:?} does not exist")]
    JobNotFound {
        /// The job id asked for.
        job: String,
    },
    /// A key is not in the store and the call did not wait for it.
    #[error("key {key:?} not found in job {job:?}")]
    KeyNotFound {
        /// Job id.
        job: String,
        /// The key.
        key: String,
    },
    /// A call carried a round that is not the job's current round (fencing).
    #[error("stale round {given} for job {job:?}: the current round is {current}")]
    StaleRound {
        /// Job id.
        job: String,
        /// The round the caller named.
        given: u64,
        /// The job's current round.
        current: u64,
    },
    /// The job ended and refuses the call.
    #[error("job {job:?} has {state}: {reason}")]
    JobEnded {
        /// Job id.
        job: String,
        /// `completed` or `failed`.
        state: &'static str,
        /// Why it ended.
        reason: String,
    },
    /// The call contradicts the job's state or configuration.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The node is not (or no longer) a member of the job.
    #[error("node {node:?} is not a member of job {job:?}: {reason}")]
    NotMember {
        /// Job id.
        job: String,
        /// Node id.
        node: String,
        /// Why (never joined, left, lease expired).
        reason: String,
    },
    /// A write-once value was already written with other contents.
    #[error("{0}")]
    AlreadyExists(String),
    /// The caller may not do this (not rank 0, other job).
    #[error("{0}")]
    PermissionDenied(String),
    /// Missing or wrong token.
    #[error("{0}")]
    Unauthenticated(String),
    /// A limit (value size, keys, jobs, nodes) would be exceeded.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The wait ran out.
    #[error("{0}")]
    Timeout(String),
    /// The service cannot make the change durable, or is unreachable.
    #[error("{0}")]
    Unavailable(String),
    /// Durable state on disk could not be read or written.
    #[error("storage error at {path}: {message}")]
    Storage {
        /// File or directory involved.
        path: String,
        /// What happened.
        message: String,
    },
    /// The daemon is shutting down.
    #[error("the rendezvous service is shutting down")]
    ShuttingDown,
    /// HA: this daemon is not the leader (a standby, or a leader that lost its lease or reached its
    /// lease's local deadline). A call refused on arrival was not applied; one refused when its
    /// answer was due (the leader stepped down meanwhile) may have been, like any `UNAVAILABLE`
    /// (clients retry with the same request id). Travels as `UNAVAILABLE` with a
    /// [`pb::NotLeader`] in the status details.
    #[error("this rendezvous daemon is not the leader{}", leader_hint(leader, *epoch))]
    NotLeader {
        /// The leader's advertised address, when known.
        leader: String,
        /// The leader's epoch (0: unknown).
        epoch: u64,
    },
    /// Client side: an answer from a leader older than one this client already heard from (a
    /// deposed leader that has not noticed yet).
    #[error("stale answer from a deposed leader of epoch {got} (epoch {seen} was already seen)")]
    StaleEpoch {
        /// The epoch of the answer.
        got: u64,
        /// The highest epoch this client saw.
        seen: u64,
    },
    /// Client side: the endpoint or TLS configuration is unusable.
    #[error("cannot connect to rendezvous endpoint {endpoint:?}: {message}")]
    Connect {
        /// The endpoint as given.
        endpoint: String,
        /// Why.
        message: String,
    },
    /// Client side: the TLS handshake with a daemon failed (a certificate its CA file does not
    /// vouch for, a name the certificate does not carry, a daemon that does not speak TLS). Retrying
    /// cannot help: the configuration has to change.
    #[error("TLS with rendezvous daemon {endpoint} failed: {message}")]
    Tls {
        /// The daemon's endpoint.
        endpoint: String,
        /// The handshake's error, and what to check.
        message: String,
    },
    // === TCPStore (PyTorch's store protocol, `tcpstore`) ===
    /// A TCPStore request broke the protocol (unknown command, missing or wrong VALIDATE, bad field).
    #[error("tcpstore protocol violation: {0}")]
    TcpStoreProtocol(String),
    /// A TCPStore request or the keyspace went over a configured limit.
    #[error("tcpstore {limit} {value} exceeds the limit of {max}")]
    TcpStoreLimit {
        /// Which limit (`key size`, `value size`, `request size`, `keys per request`, `store size`).
        limit: &'static str,
        /// The size or count that was asked for.
        value: u64,
        /// The configured maximum.
        max: u64,
    },
    /// ADD or BARRIER found a stored value that is not a 64-bit integer (torch's `std::stoll` fails
    /// there too), or the sum overflows.
    #[error("tcpstore value of key {key:?} is not a 64-bit integer or overflows: {value:?}")]
    TcpStoreNotANumber {
        /// The key (lossy UTF-8, shortened).
        key: String,
        /// The stored value, or the overflowing sum (lossy UTF-8, shortened).
        value: String,
    },
    /// A TCPStore client (our own, used by tests and benchmarks) failed to talk to a server.
    #[error("tcpstore client for {addr}: {message}")]
    TcpStoreClient {
        /// The server address.
        addr: String,
        /// What happened.
        message: String,
    },
    /// Client side: a status from the server that maps to no other variant.
    #[error("rendezvous rpc failed ({code:?}): {message}")]
    Rpc {
        /// The gRPC code.
        code: Code,
        /// The server's message.
        message: String,
    },
}

fn leader_hint(leader: &str, epoch: u64) -> String {
    match (leader.is_empty(), epoch) {
        (true, _) => ": no leader is known yet (an election is running)".into(),
        (false, 0) => format!(": the leader is at {leader}"),
        (false, e) => format!(": the leader is at {leader} (epoch {e})"),
    }
}

impl RdzvError {
    /// Shorthand for [`RdzvError::InvalidArgument`].
    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        RdzvError::InvalidArgument { field, message: message.into() }
    }

    /// The gRPC code this error travels as.
    pub fn code(&self) -> Code {
        match self {
            RdzvError::InvalidArgument { .. } | RdzvError::TcpStoreProtocol(_) => Code::InvalidArgument,
            RdzvError::JobNotFound { .. } | RdzvError::KeyNotFound { .. } => Code::NotFound,
            RdzvError::StaleRound { .. }
            | RdzvError::JobEnded { .. }
            | RdzvError::FailedPrecondition(_)
            | RdzvError::NotMember { .. }
            | RdzvError::TcpStoreNotANumber { .. } => Code::FailedPrecondition,
            RdzvError::AlreadyExists(_) => Code::AlreadyExists,
            RdzvError::PermissionDenied(_) => Code::PermissionDenied,
            RdzvError::Unauthenticated(_) => Code::Unauthenticated,
            RdzvError::ResourceExhausted(_) | RdzvError::TcpStoreLimit { .. } => Code::ResourceExhausted,
            RdzvError::Timeout(_) => Code::DeadlineExceeded,
            RdzvError::Unavailable(_)
            | RdzvError::ShuttingDown
            | RdzvError::Connect { .. }
            | RdzvError::Tls { .. }
            | RdzvError::TcpStoreClient { .. }
            | RdzvError::NotLeader { .. }
            | RdzvError::StaleEpoch { .. } => Code::Unavailable,
            RdzvError::Storage { .. } => Code::Internal,
            RdzvError::Rpc { code, .. } => *code,
        }
    }

    /// True for errors a client may retry (the service was unreachable or restarting).
    pub fn is_retryable(&self) -> bool {
        self.code() == Code::Unavailable && !matches!(self, RdzvError::Tls { .. })
    }
}

/// The one conversion of the service's errors into gRPC statuses.
impl From<RdzvError> for Status {
    fn from(err: RdzvError) -> Self {
        if let RdzvError::NotLeader { leader, epoch } = &err {
            let details = pb::NotLeader { leader_endpoint: leader.clone(), epoch: *epoch, daemon_id: String::new() }.encode_to_vec();
            return Status::with_details(err.code(), err.to_string(), details.into());
        }
        Status::new(err.code(), capped(err.to_string()))
    }
}

/// Most bytes of an error's text in a status (`grpc-message`, a header): percent-encoded, a
/// longer one could pass the client's 16 KiB header limit, which resets the stream and loses
/// the message (a job's failure reason among them).
const MAX_STATUS_MESSAGE: usize = 4096;

fn capped(mut text: String) -> String {
    if text.len() > MAX_STATUS_MESSAGE {
        let mut cut = MAX_STATUS_MESSAGE;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push_str("...");
    }
    text
}

/// Client side: a status received from the server. The message is kept as the server wrote it.
impl From<Status> for RdzvError {
    fn from(status: Status) -> Self {
        let message = status.message().to_string();
        match status.code() {
            Code::InvalidArgument => RdzvError::InvalidArgument { field: "request", message },
            Code::NotFound => RdzvError::Rpc { code: Code::NotFound, message },
            Code::FailedPrecondition => RdzvError::FailedPrecondition(message),
            Code::AlreadyExists => RdzvError::AlreadyExists(message),
            Code::PermissionDenied => RdzvError::PermissionDenied(message),
            Code::Unauthenticated => RdzvError::Unauthenticated(message),
            Code::ResourceExhausted => RdzvError::ResourceExhausted(message),
            Code::DeadlineExceeded => RdzvError::Timeout(message),
            Code::Unavailable if !status.details().is_empty() => match pb::NotLeader::decode(status.details()) {
                Ok(n) => RdzvError::NotLeader { leader: n.leader_endpoint, epoch: n.epoch },
                Err(_) => RdzvError::Unavailable(message),
            },
            Code::Unavailable | Code::Cancelled => {
                RdzvError::Unavailable(if message.is_empty() { "service unavailable".into() } else { message })
            }
            // tonic's own statuses for a broken transport (a reset stream, a connection gone)
            // carry that error as their source: retryable. One the server sent (a handler's
            // Internal, an HTTP error mapped to Unknown) is an answer: retrying it only waited
            // out the deadline and then said "unreachable".
            Code::Unknown | Code::Internal if std::error::Error::source(&status).is_some() => {
                RdzvError::Unavailable(if message.is_empty() { "the connection failed".into() } else { message })
            }
            code => RdzvError::Rpc { code, message },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A status the server sent is an answer (not retried); tonic's own status for a broken
    /// transport carries the transport error and is retried; a long message is capped.
    #[test]
    fn statuses_from_the_server_and_from_the_transport() {
        let sent = RdzvError::from(Status::new(Code::Unknown, "HTTP status 431"));
        assert!(!sent.is_retryable(), "{sent:?}");
        let sent = RdzvError::from(Status::new(Code::Internal, "storage failed"));
        assert!(!sent.is_retryable(), "{sent:?}");
        let mut broken = Status::new(Code::Internal, "h2 protocol error: stream reset");
        broken.set_source(std::sync::Arc::new(std::io::Error::from(std::io::ErrorKind::ConnectionReset)));
        assert!(RdzvError::from(broken).is_retryable());
        assert!(RdzvError::from(Status::new(Code::Unavailable, "")).is_retryable());
        let long = Status::from(RdzvError::FailedPrecondition("\u{fffd}".repeat(10_000)));
        assert!(long.message().len() <= MAX_STATUS_MESSAGE + 3 && long.message().ends_with("..."), "{}", long.message().len());
    }
}
