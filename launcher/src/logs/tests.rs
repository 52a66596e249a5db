use super::*;
use std::time::Duration;

fn events(rx: &mut mpsc::Receiver<ConsoleEvent>) -> Vec<ConsoleEvent> {
    let mut got = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        got.push(ev);
    }
    got
}

#[tokio::test]
async fn lines_are_prefixed_tailed_and_filed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stderr.log");
    let dup_path = dir.path().join("filtered_stderr.log");
    let (tx, mut rx) = mpsc::channel(16);
    let tail = Arc::new(Mutex::new(Tail::new(2)));
    let sink = StreamSink {
        file: Some(LogFile::new(std::fs::File::create(&path).unwrap(), path.clone())),
        console: Some(ConsoleSink { tx, prefix: b"[rank 3] ".to_vec(), mode: ConsoleMode::Plain, prompts: false }),
        tail: Some(tail.clone()),
        duplicate: Some((
            Arc::new(vec!["loss".into()]),
            Arc::new(tokio::sync::Mutex::new(LogFile::new(std::fs::File::create(&dup_path).unwrap(), dup_path.clone()))),
        )),
        quiet: None,
    };
    let input: &[u8] = b"one\ntwo loss=1\r\nthree";
    pump(input, StreamKind::Stderr, sink).await;
    assert_eq!(
        events(&mut rx),
        vec![
            ConsoleEvent::Stderr(b"[rank 3] one\n".to_vec()),
            ConsoleEvent::Stderr(b"[rank 3] two loss=1\n".to_vec()),
            ConsoleEvent::Stderr(b"[rank 3] three\n".to_vec()),
        ]
    );
    assert_eq!(tail.lock().unwrap().lines(), vec!["two loss=1", "three"]);
    assert_eq!(std::fs::read(&path).unwrap(), input);
    assert_eq!(std::fs::read_to_string(&dup_path).unwrap(), "two loss=1\n");
}

/// A reader that yields the given chunks, one per read.
struct Chunks(std::collections::VecDeque<&'static [u8]>);

impl AsyncRead for Chunks {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if let Some(chunk) = self.0.pop_front() {
            buf.put_slice(chunk);
        }
        std::task::Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn terminal_progress_is_in_place_and_files_keep_raw_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stderr.log");
    let (tx, mut rx) = mpsc::channel(16);
    let tail = Arc::new(Mutex::new(Tail::new(4)));
    let sink = StreamSink {
        file: Some(LogFile::new(std::fs::File::create(&path).unwrap(), path.clone())),
        console: Some(ConsoleSink { tx, prefix: b"[r0] ".to_vec(), mode: ConsoleMode::Terminal, prompts: false }),
        tail: Some(tail.clone()),
        duplicate: None,
        quiet: None,
    };
    let chunks: [&'static [u8]; 4] = [b"start\n\r 1/2", b"\r 2/2", b"\r\n", b"end\r\n"];
    pump(Chunks(chunks.into_iter().collect()), StreamKind::Stderr, sink).await;
    let progress = |text: &[u8], done| ConsoleEvent::Progress { source: 0, stream: StreamKind::Stderr, text: text.to_vec(), done };
    let mut got = events(&mut rx);
    for ev in &mut got {
        if let ConsoleEvent::Progress { source, .. } = ev {
            *source = 0;
        }
    }
    assert_eq!(
        got,
        vec![
            ConsoleEvent::Stderr(b"[r0] start\n".to_vec()),
            progress(b"[r0]  1/2", false),
            progress(b"[r0]  2/2", false),
            progress(b"[r0]  2/2", true),
            ConsoleEvent::Stderr(b"[r0] end\n".to_vec()),
        ]
    );
    assert_eq!(tail.lock().unwrap().lines(), vec!["start", " 2/2", "end"], "updates are not in the tail");
    assert_eq!(std::fs::read(&path).unwrap(), chunks.concat());
}

#[tokio::test(start_paused = true)]
async fn plain_progress_stalled_on_a_pipe_is_printed_after_a_second() {
    let (mut w, r) = tokio::io::duplex(1024);
    let (tx, mut rx) = mpsc::channel(16);
    let sink = StreamSink {
        console: Some(ConsoleSink { tx, prefix: b"> ".to_vec(), mode: ConsoleMode::Plain, prompts: false }),
        ..StreamSink::default()
    };
    let task = tokio::spawn(pump(r, StreamKind::Stdout, sink));
    use tokio::io::AsyncWriteExt;
    w.write_all(b"\rloading 0%").await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(events(&mut rx), vec![], "a segment still being written is not printed");
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(events(&mut rx), vec![ConsoleEvent::Stdout(b"> loading 0%\n".to_vec())]);
    w.write_all(b"\rloading 100%\n").await.unwrap();
    drop(w);
    task.await.unwrap();
    assert_eq!(events(&mut rx), vec![ConsoleEvent::Stdout(b"> loading 100%\n".to_vec())]);
}

/// A muted pump (the round is over, the pipe still open) keeps the file, not the console.
#[tokio::test]
async fn muted_pump_keeps_writing_the_file_only() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stdout.log");
    let (mut w, r) = tokio::io::duplex(1024);
    let (tx, mut rx) = mpsc::channel(16);
    let quiet = CancellationToken::new();
    let sink = StreamSink {
        file: Some(LogFile::new(std::fs::File::create(&path).unwrap(), path.clone())),
        console: Some(ConsoleSink { tx, prefix: b"> ".to_vec(), mode: ConsoleMode::Plain, prompts: false }),
        quiet: Some(quiet.clone()),
        ..StreamSink::default()
    };
    let task = tokio::spawn(pump(r, StreamKind::Stdout, sink));
    w.write_all(b"before\n").await.unwrap();
    assert_eq!(rx.recv().await, Some(ConsoleEvent::Stdout(b"> before\n".to_vec())));
    quiet.cancel();
    w.write_all(b"after\n").await.unwrap();
    drop(w);
    task.await.unwrap();
    assert_eq!(events(&mut rx), vec![]);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "before\nafter\n");
}

/// A log file that cannot take more (here a pipe nobody reads: a hung disk) holds up its own
/// stream only: the launcher's one thread keeps running its other tasks. Once the write fails,
/// the pump goes on without the file and ends.
#[test]
fn a_stuck_log_file_does_not_hold_up_the_launchers_thread() {
    let (reader, writer) = std::io::pipe().unwrap();
    let path = std::path::PathBuf::from("stuck.log");
    let (said, hear) = std::sync::mpsc::channel::<&str>();
    let (go_on, wait_go) = std::sync::mpsc::channel::<()>();
    let runtime = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let file = std::fs::File::from(std::os::fd::OwnedFd::from(writer));
            let sink = StreamSink { file: Some(LogFile::new(file, path)), ..StreamSink::default() };
            // 1 MiB of output: far more than a pipe holds.
            let input: &'static [u8] = Box::leak(vec![b'x'; 1 << 20].into_boxed_slice());
            let pump = tokio::spawn(pump(input, StreamKind::Stdout, sink));
            for _ in 0..20 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(!pump.is_finished(), "the file took 1 MiB: it is not stuck");
            said.send("ticked").unwrap();
            tokio::task::spawn_blocking(move || wait_go.recv()).await.unwrap().unwrap();
            pump.await.unwrap();
            said.send("ended").unwrap();
        });
    });
    let got = hear.recv_timeout(Duration::from_secs(20));
    assert_eq!(got, Ok("ticked"), "the launcher's thread stopped while a log file was stuck");
    // The disk fails: the write errors (EPIPE), the pump drops the file and reads to the end.
    drop(reader);
    go_on.send(()).unwrap();
    assert_eq!(hear.recv_timeout(Duration::from_secs(20)), Ok("ended"));
    runtime.join().unwrap();
}
