//! The daemon's log lines stay bounded under load: a request span is attached to its own future
//! (`Instrument`), never entered across an `.await`, so spans of concurrent requests do not nest into
//! each other. (Before, one log line of a 1,024-agent round carried 506 nested `join{...}` spans.)

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rsrun_rendezvous::client::{ClientConfig, JobSpec, JoinSpec, RdzvClient};
use rsrun_rendezvous::server;

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_lines_stay_bounded_with_a_thousand_agents() {
    let sink = Sink::default();
    let writer = sink.clone();
    tracing_subscriber::fmt()
        .with_env_filter("rsrun_rendezvous=debug")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let srv = server::spawn_embedded("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let n = 1_000u32;
    let spec = JobSpec {
        min_nodes: n,
        max_nodes: n,
        last_call: Duration::ZERO,
        lease: Duration::from_secs(120),
        max_restarts: 0,
        fixed_ranks: false,
    };
    let clients: Vec<RdzvClient> =
        (0..16).map(|_| RdzvClient::connect(ClientConfig::new(srv.addr.to_string())).unwrap()).collect();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let c = clients[i as usize % clients.len()].clone();
            let js = JoinSpec {
                job_id: "bounded".into(),
                node_id: format!("agent-{i}"),
                addrs: vec!["127.0.0.1".into()],
                local_world_size: 1,
                rank_hint: None,
                config: spec.clone(),
                timeout: Duration::from_secs(120),
                master_port: 29_500,
                hostname: format!("host-{i}"),
            };
            tokio::spawn(async move { c.join(js).await.unwrap() })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    // Every agent has its assignment: now they all leave (a leave ends the round for the others).
    let leaves: Vec<_> = (0..n)
        .map(|i| {
            let c = clients[i as usize % clients.len()].clone();
            tokio::spawn(async move { c.leave("bounded", &format!("agent-{i}"), "done").await.unwrap() })
        })
        .collect();
    for t in leaves {
        t.await.unwrap();
    }
    let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.iter().any(|l| l.contains("round formed")), "no round formed line in {} lines", lines.len());
    assert!(lines.iter().filter(|l| l.contains("node left")).count() >= n as usize);
    let longest = lines.iter().map(|l| l.len()).max().unwrap_or(0);
    let most_spans = lines.iter().map(|l| l.matches("join{").count()).max().unwrap_or(0);
    assert!(most_spans <= 1, "a line carries {most_spans} nested join spans");
    assert!(longest < 1_000, "the longest log line has {longest} bytes");
}
