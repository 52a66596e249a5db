//! Length-delimited protobuf frames on the agent's stdin and stdout (see `proto/rsrun/v1/launch.proto`),
//! and the version check of a `NodeLaunch`.

use std::io::{self, Read, Write};

use prost::Message;
use rsrun_rendezvous::proto::{AgentEvent, NodeLaunch};
use tokio::io::{AsyncRead, AsyncReadExt};

/// The protocol this rsrun speaks; an agent refuses a `NodeLaunch` with another one.
pub const NODE_LAUNCH_PROTOCOL: u32 = 2;
/// This rsrun's version.
pub const RSRUN_VERSION: &str = env!("CARGO_PKG_VERSION");
/// Largest frame accepted (a plan with a large forwarded environment is well below).
pub const MAX_FRAME: usize = 64 << 20;

/// Encodes one frame.
pub fn encode<M: Message>(m: &M) -> Vec<u8> {
    m.encode_length_delimited_to_vec()
}

/// Writes one frame and flushes.
///
/// # Errors
/// The write failed (the reader is gone).
pub fn write_frame<M: Message>(w: &mut impl Write, m: &M) -> io::Result<()> {
    w.write_all(&encode(m))?;
    w.flush()
}

/// Reads one frame, blocking, without reading a byte past it (the rest of the stream stays for the
/// next reader). `Ok(None)` on a clean EOF before the frame.
///
/// # Errors
/// A read error, a truncated frame, or a frame over [`MAX_FRAME`].
pub fn read_frame(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len: u64 = 0;
    for i in 0..10 {
        let mut b = [0u8; 1];
        if r.read(&mut b)? == 0 {
            return if i == 0 { Ok(None) } else { Err(io::Error::new(io::ErrorKind::UnexpectedEof, "truncated frame length")) };
        }
        len |= u64::from(b[0] & 0x7f) << (7 * i);
        if b[0] & 0x80 == 0 {
            return read_body(r, len).map(Some);
        }
    }
    Err(io::Error::new(io::ErrorKind::InvalidData, "frame length is not a varint"))
}

fn read_body(r: &mut impl Read, len: u64) -> io::Result<Vec<u8>> {
    if len > MAX_FRAME as u64 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("frame of {len} bytes (at most {MAX_FRAME})")));
    }
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// The async twin of [`read_frame`] (the head reads agents' stdout with it).
///
/// # Errors
/// As [`read_frame`].
pub async fn read_frame_async(r: &mut (impl AsyncRead + Unpin)) -> io::Result<Option<Vec<u8>>> {
    let mut len: u64 = 0;
    for i in 0..10 {
        let mut b = [0u8; 1];
        if r.read(&mut b).await? == 0 {
            return if i == 0 { Ok(None) } else { Err(io::Error::new(io::ErrorKind::UnexpectedEof, "truncated frame length")) };
        }
        len |= u64::from(b[0] & 0x7f) << (7 * i);
        if b[0] & 0x80 == 0 {
            if len > MAX_FRAME as u64 {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("frame of {len} bytes (at most {MAX_FRAME})")));
            }
            let mut buf = vec![0u8; len as usize];
            r.read_exact(&mut buf).await?;
            return Ok(Some(buf));
        }
    }
    Err(io::Error::new(io::ErrorKind::InvalidData, "frame length is not a varint"))
}

/// Decodes an agent event.
///
/// # Errors
/// Not an `AgentEvent`.
pub fn decode_event(buf: &[u8]) -> io::Result<AgentEvent> {
    AgentEvent::decode(buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("not an AgentEvent: {e}")))
}

/// Decodes the first frame on an agent's stdin and checks its versions.
///
/// # Errors
/// A message that is not a `NodeLaunch` or that comes from another protocol or rsrun version, with a
/// message naming both sides.
pub fn decode_launch(buf: &[u8], this_host: &str) -> Result<NodeLaunch, String> {
    let launch = NodeLaunch::decode(buf).map_err(|e| {
        format!("stdin does not start with a NodeLaunch message ({e}); `rsrun agent --stdin` is started by `rsrun --hosts/--hostfile`")
    })?;
    if launch.protocol_version != NODE_LAUNCH_PROTOCOL {
        return Err(format!(
            "the launcher speaks remote-launch protocol {} but rsrun {RSRUN_VERSION} on {this_host} speaks {NODE_LAUNCH_PROTOCOL}; install the same rsrun on every host or pass --remote-rsrun",
            launch.protocol_version
        ));
    }
    if launch.rsrun_version != RSRUN_VERSION {
        return Err(format!(
            "rsrun {RSRUN_VERSION} on {this_host} but the launcher is {}; install the same version or pass --remote-rsrun",
            launch.rsrun_version
        ));
    }
    Ok(launch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rsrun_rendezvous::proto::{Control, control};

    #[test]
    fn frames_round_trip_without_over_reading() {
        let launch = NodeLaunch {
            protocol_version: NODE_LAUNCH_PROTOCOL,
            rsrun_version: RSRUN_VERSION.into(),
            env: [("BIG".to_owned(), vec![b'x'; 300_000])].into_iter().collect(),
            ..Default::default()
        };
        let stop = Control { action: control::Action::Stop as i32, signal: 2 };
        let mut bytes = encode(&launch);
        bytes.extend(encode(&stop));
        let mut r = io::Cursor::new(bytes);
        let first = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(decode_launch(&first, "h").unwrap(), launch);
        let second = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(Control::decode(second.as_slice()).unwrap(), stop);
        assert!(read_frame(&mut r).unwrap().is_none());
        assert!(read_frame(&mut io::Cursor::new(vec![0x85])).is_err(), "truncated");
    }

    #[test]
    fn versions_are_checked() {
        let mut l = NodeLaunch { protocol_version: 9, rsrun_version: RSRUN_VERSION.into(), ..Default::default() };
        let e = decode_launch(&encode(&l)[1..], "w2").unwrap_err();
        assert!(e.contains("protocol 9") && e.contains("on w2"), "{e}");
        l.protocol_version = NODE_LAUNCH_PROTOCOL;
        l.rsrun_version = "0.0.1".into();
        let e = decode_launch(&encode(&l)[1..], "w2").unwrap_err();
        assert_eq!(e, format!("rsrun {RSRUN_VERSION} on w2 but the launcher is 0.0.1; install the same version or pass --remote-rsrun"));
    }
}
