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

/// What the first bytes of an agent's stdout say about it, read so far (`prefix`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstFrame {
    /// A frame length and the tag of one of `AgentEvent`'s fields: the agent protocol.
    Plausible,
    /// Something else (text a wrapper or a login script printed).
    Garbled,
    /// Too few bytes to tell.
    NeedMore,
}

/// The tags (field number and wire type 2) of `AgentEvent`'s fields, one of which an agent's
/// every message starts with.
const EVENT_TAGS: [u8; 5] = [0x0a, 0x12, 0x1a, 0x22, 0x2a];

/// Tells from the first bytes of an agent's stdout whether they begin a message of the agent
/// protocol: a varint length from 1 to [`MAX_FRAME`], then one of `AgentEvent`'s field tags.
pub fn first_frame(prefix: &[u8]) -> FirstFrame {
    let mut len: u64 = 0;
    for (i, b) in prefix.iter().enumerate().take(10) {
        len |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            if len == 0 || len > MAX_FRAME as u64 {
                return FirstFrame::Garbled;
            }
            return match prefix.get(i + 1) {
                Some(tag) if EVENT_TAGS.contains(tag) => FirstFrame::Plausible,
                Some(_) => FirstFrame::Garbled,
                None => FirstFrame::NeedMore,
            };
        }
    }
    if prefix.len() >= 10 { FirstFrame::Garbled } else { FirstFrame::NeedMore }
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

    /// Every message an agent sends begins as the agent protocol says; text does not, and a
    /// prefix too short to tell asks for more.
    #[test]
    fn the_first_frame_tells_the_agent_from_text() {
        use rsrun_rendezvous::proto::{AgentReady, agent_event};
        let events = [
            agent_event::Event::Ready(AgentReady::default()),
            agent_event::Event::Note("n".into()),
            agent_event::Event::StartFailed("why".into()),
            agent_event::Event::Note("x".repeat(300)),
        ];
        for ev in events {
            let bytes = encode(&AgentEvent { event: Some(ev.clone()) });
            assert_eq!(first_frame(&bytes), FirstFrame::Plausible, "{ev:?}");
            for cut in 0..bytes.len().min(3) {
                let want = if cut <= 1 + usize::from(bytes[0] >= 0x80) { FirstFrame::NeedMore } else { FirstFrame::Plausible };
                assert_eq!(first_frame(&bytes[..cut]), want, "{ev:?} cut at {cut}");
            }
        }
        for text in ["Welcome to h2\n", "Last login: Thu Nov 26\n", "hi", "zz"] {
            assert_eq!(first_frame(text.as_bytes()), FirstFrame::Garbled, "{text:?}");
        }
        // A zero length, a length past MAX_FRAME, or a varint that never ends.
        assert_eq!(first_frame(&[0x00, 0x0a]), FirstFrame::Garbled);
        assert_eq!(first_frame(&[0xff, 0xff, 0xff, 0xff, 0x7f, 0x0a]), FirstFrame::Garbled);
        assert_eq!(first_frame(&[0x80; 10]), FirstFrame::Garbled);
        assert_eq!(first_frame(&[0x80; 3]), FirstFrame::NeedMore);
        assert_eq!(first_frame(&[]), FirstFrame::NeedMore);
    }

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
