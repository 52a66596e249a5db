use super::*;

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
        file: Some(std::fs::File::create(&path).unwrap()),
        console: Some(ConsoleSink { tx, prefix: b"[rank 3] ".to_vec(), mode: ConsoleMode::Plain }),
        tail: Some(tail.clone()),
        duplicate: Some((
            Arc::new(vec!["loss".into()]),
            Arc::new(Mutex::new(std::fs::File::create(&dup_path).unwrap())),
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
        file: Some(std::fs::File::create(&path).unwrap()),
        console: Some(ConsoleSink { tx, prefix: b"[r0] ".to_vec(), mode: ConsoleMode::Terminal }),
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
        console: Some(ConsoleSink { tx, prefix: b"> ".to_vec(), mode: ConsoleMode::Plain }),
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
        file: Some(std::fs::File::create(&path).unwrap()),
        console: Some(ConsoleSink { tx, prefix: b"> ".to_vec(), mode: ConsoleMode::Plain }),
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
