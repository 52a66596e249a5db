//! Collective benchmark with the nccl-tests conventions.
//!
//! Run under the launcher (reads RANK and WORLD_SIZE from the environment and bootstraps through the
//! rendezvous store, so it also works across hosts; under another launcher, or with `--store-dir`, it
//! falls back to a file store on the local host):
//!
//!     rsrun --standalone --nproc-per-node 2 target/release/collectives-bench
//!
//! or standalone, spawning its own ranks:
//!
//!     target/release/collectives-bench --spawn 2
//!
//! Prints the machine, then the physical limits measured in the same run: memcpy bandwidth per
//! rank with every rank copying 64 MiB at once (bytes read + written per second), one TCP
//! stream over loopback, and (two ranks on one host) 64 MiB sent each way at once over one
//! loopback connection between the ranks (the traffic of a two-rank all_reduce). Then one line
//! per (backend, op, size):
//! `op=all_reduce backend=shm world=2 bytes=67108864 time_us=... algbw_GBps=... busbw_GBps=...`
//! with `algbw = bytes / time` and `busbw = algbw · 2(N−1)/N` (all_reduce) or `· (N−1)/N`
//! (reduce_scatter: bytes = input; all_gather: bytes = output).
//!
//! The memory-traffic bound of an op is the time each rank needs just to read its input once
//! and write its output once at the measured memory bandwidth, the better of a memcpy and an
//! in-place fold (`machine::fold_gbps`: its writes go to lines it read, as a reduction's do,
//! and pay no read-for-ownership; with memcpy alone the in-place all_reduce passed its "bound")
//! (all_reduce `2B`, reduce_scatter `B + B/N`, all_gather `B/N + B` bytes of traffic per rank
//! for `B` bytes; `memcpy_gbps` in the summary is that bandwidth); `frac` is that time
//! over the measured one. A shared host has slow spells that last seconds, so the headline
//! fraction of each op is paired: five rounds of the limit measured right before the op (a few
//! calls), the median of the five ratios (`bound:` lines list them as `paired_rounds`, beside
//! `frac_of_first_limit`, the sweep's time over the limits measured once at the start); TCP's
//! all_reduce is paired the same way with a loopback stream. The memcpy pays a
//! read-for-ownership for every line it writes; the shm backend writes big all_gather outputs
//! with streaming stores, which do not, so their `frac` can pass 1. On the shm backend all_reduce and all_gather run twice: on buffers
//! registered with the group (`ProcessGroup::alloc_shared`, the zero-copy path DDP's gradients
//! use; `buffers=registered`) and on plain vectors (`buffers=plain`, staged through the
//! segment); reduce_scatter runs on a registered input and a plain one. The headline fractions
//! use registered buffers where an op has them, and the plain
//! ones follow as `*_plain_frac`. Ends with
//! `summary: allreduce_frac_of_bound=... reduce_scatter_frac=... all_gather_frac=...
//! tcp_frac_of_loopback=... allreduce_plain_frac=... reduce_scatter_plain_frac=...
//! all_gather_plain_frac=... memcpy_gbps=... loopback_tcp_gbps=... ...` (the 64 MiB figures;
//! `tcp_frac_of_loopback` is the TCP backend's all_reduce busbw over one loopback stream, and
//! with two ranks on one host `tcp_frac_of_exchange` the same busbw over the exchange that
//! moves a two-rank all_reduce's traffic, 64 MiB each way at once between the ranks, with
//! nothing else to do: the most a TCP all_reduce can reach on this host).

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rsrun_examples::machine::{PageBuf, Pages};
use rsrun_training_engine::comm::{BackendKind, CommOptions, FileStore, ProcessGroup, ReduceOp};

const DEFAULT_SIZES: &[usize] = &[
    1 << 10,
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
];

struct Args {
    spawn: Option<usize>,
    sizes: Vec<usize>,
    backends: Vec<String>,
    ops: Vec<String>,
    store_dir: Option<PathBuf>,
    chunk: Option<usize>,
}

/// `v` as a whole number of at least `min`, or an error naming `flag` and the value.
fn count(flag: &str, v: &str, min: usize) -> Result<usize> {
    match v.parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        _ => bail!("{flag} {v:?}: expected a whole number, {min} or more"),
    }
}

/// A comma-separated list whose every item is one of `allowed`.
fn one_of(flag: &str, v: &str, allowed: &[&str]) -> Result<Vec<String>> {
    v.split(',')
        .map(|item| {
            if allowed.contains(&item) {
                Ok(item.to_owned())
            } else {
                bail!("{flag} {item:?}: expected one of {}", allowed.join(", "))
            }
        })
        .collect()
}

/// The ops `--ops` takes, each timed by [`time_op_iters`].
const OPS: [&str; 4] = ["all_reduce", "reduce_scatter", "all_gather", "broadcast"];

fn parse_args() -> Result<Args> {
    let mut a = Args {
        spawn: None,
        sizes: DEFAULT_SIZES.to_vec(),
        backends: vec!["auto".into(), "tcp".into()],
        ops: vec![
            "all_reduce".into(),
            "reduce_scatter".into(),
            "all_gather".into(),
        ],
        store_dir: None,
        chunk: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().with_context(|| format!("{k} needs a value"));
        match k.as_str() {
            "--spawn" => a.spawn = Some(count("--spawn", &v()?, 1)?),
            "--sizes" => {
                a.sizes = v()?
                    .split(',')
                    .map(|s| {
                        let b = count("--sizes", s, 4)?;
                        if b % 4 != 0 {
                            bail!("--sizes {s:?}: expected a whole number of f32 elements (a multiple of 4 bytes)");
                        }
                        Ok(b)
                    })
                    .collect::<Result<_>>()?
            }
            "--backends" => {
                a.backends = v()?.split(',').map(String::from).collect();
                for b in &a.backends {
                    b.parse::<BackendKind>().map_err(|e| anyhow::anyhow!("--backends: {e}"))?;
                }
            }
            "--ops" => a.ops = one_of("--ops", &v()?, &OPS)?,
            "--store-dir" => a.store_dir = Some(v()?.into()),
            "--shm-chunk-bytes" => a.chunk = Some(count("--shm-chunk-bytes", &v()?, 1)?),
            "-h" | "--help" => {
                writeln!(
                    std::io::stdout(),
                    "collectives-bench [--spawn N] [--sizes B,..] [--backends auto,shm,tcp,hierarchical] [--ops {}] [--store-dir DIR] [--shm-chunk-bytes B]",
                    OPS.join(",")
                )?;
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}"),
        }
    }
    Ok(a)
}

fn env_usize(k: &str) -> Result<usize> {
    std::env::var(k)
        .with_context(|| format!("{k} is not set (run under rsrun, or use --spawn N)"))?
        .parse()
        .with_context(|| format!("{k} is not a number"))
}

/// Spawns `n` ranks of this binary with the launcher's environment variables.
fn spawn(n: usize) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("collectives-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let exe = std::env::current_exe()?;
    let args: Vec<String> = {
        let mut out = Vec::new();
        let mut it = std::env::args().skip(1);
        while let Some(a) = it.next() {
            if a == "--spawn" {
                it.next();
            } else {
                out.push(a);
            }
        }
        out
    };
    let children: Vec<_> = (0..n)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args(&args)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .arg("--store-dir")
                .arg(&dir)
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let mut ok = true;
    for mut c in children {
        ok &= c.wait()?.success();
    }
    let _ = std::fs::remove_dir_all(&dir);
    if !ok {
        bail!("a rank failed");
    }
    Ok(())
}

/// Bytes each rank must read and write at least for `op` on `bytes` (its input read once, its
/// output written once).
fn traffic_bytes(op: &str, bytes: usize, n: usize) -> f64 {
    let b = bytes as f64;
    match op {
        "all_reduce" => 2.0 * b,
        "reduce_scatter" | "all_gather" => b + b / n as f64,
        _ => 2.0 * b,
    }
}

/// Rounds of the paired measurement of each memory-bound op (and of TCP against a stream).
const PAIRED_ROUNDS: usize = 5;
/// Bytes of the loopback stream of each paired TCP round.
const PAIRED_STREAM_BYTES: usize = 256 << 20;

/// GB/s (read + write) of the better of a memcpy and an in-place fold over `op`'s footprint at
/// `bytes`, every rank at once.
fn memcpy_paired(pg: &ProcessGroup, op: &str, bytes: usize, world: usize) -> Result<f64> {
    let footprint = if op == "all_reduce" { bytes } else { bytes + bytes / world };
    pg.barrier()?;
    let (copy, fold) = rsrun_examples::machine::memory_gbps(footprint / 2);
    Ok(copy.max(fold))
}

/// `0.91/0.88/...` for the paired rounds, `n/a` without them.
fn rounds_text(f: Option<&Vec<f64>>) -> String {
    f.map_or("n/a".to_string(), |f| f.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join("/"))
}

fn busbw_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "reduce_scatter" | "all_gather" => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// A benchmark buffer: a plain vector, or one registered with the group
/// (`ProcessGroup::alloc_shared`, the zero-copy path on shm).
fn bench_buf(
    pg: &ProcessGroup,
    len: usize,
    fill: f32,
    registered: bool,
) -> Result<Box<dyn std::ops::DerefMut<Target = [f32]>>> {
    Ok(if registered {
        let mut b = pg.alloc_shared::<f32>(len)?;
        b.fill(fill);
        Box::new(b)
    } else {
        Box::new(vec![fill; len])
    })
}

/// Times `iters` calls of `op` at `bytes` bytes; returns the slowest rank's mean seconds.
/// `registered`: the all_reduce buffer, the all_gather output and the reduce_scatter input come
/// from `alloc_shared`.
fn time_op(pg: &ProcessGroup, op: &str, bytes: usize, registered: bool) -> Result<f64> {
    let iters = (2e9 / bytes as f64).clamp(5.0, 5000.0) as usize;
    time_op_iters(pg, op, bytes, registered, iters.min(20), iters)
}

/// Mean seconds per call of `op` over `iters` calls after `warm` untimed ones (the slowest
/// rank's figure).
fn time_op_iters(pg: &ProcessGroup, op: &str, bytes: usize, registered: bool, warm: usize, iters: usize) -> Result<f64> {
    let n = pg.world_size();
    let elems = (bytes / 4).max(1);
    let per = (elems / n).max(1);
    let mut buf = bench_buf(pg, elems, 1.0, registered && op == "all_reduce")?;
    let mut shard = vec![1.0f32; per];
    // Not 0.0: a zero-filled vector is calloc'd pages that nothing wrote, which all read the
    // kernel's one zero page, so reduce_scatter (its input) would read from cache, not memory.
    let mut full = bench_buf(pg, per * n, 1.0, registered && matches!(op, "all_gather" | "reduce_scatter"))?;
    let mut run = |pg: &ProcessGroup| -> Result<()> {
        match op {
            "all_reduce" => pg.all_reduce(&mut buf, ReduceOp::Sum)?,
            "reduce_scatter" => pg.reduce_scatter(&full, &mut shard, ReduceOp::Sum)?,
            "all_gather" => pg.all_gather(&shard, &mut full)?,
            "broadcast" => pg.broadcast(&mut buf, 0)?,
            other => bail!("unknown op {other}; expected one of {}", OPS.join(", ")),
        }
        Ok(())
    };
    for _ in 0..warm {
        run(pg)?;
    }
    pg.barrier()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        run(pg)?;
    }
    let mut dt = [t0.elapsed().as_secs_f64() / iters as f64];
    pg.all_reduce(&mut dt, ReduceOp::Max)?;
    Ok(dt[0])
}

/// The two-way TCP exchange limit (`machine::tcp_exchange_secs`) between the two ranks of a
/// two-rank group on one host: GB/s each way, best of three on each kind of `Pages`, the same
/// on both ranks. `None` for other group sizes, and when the ranks' host identities differ
/// (`comm::host_identity`: another machine or network namespace, which loopback does not reach).
fn exchange_gbps(
    pg: &ProcessGroup,
    store: &dyn rsrun_training_engine::comm::Store,
    rank: usize,
    bytes: usize,
) -> Result<Option<f64>> {
    if pg.world_size() != 2 {
        return Ok(None);
    }
    let wait = Duration::from_secs(60);
    let host = rsrun_training_engine::comm::host_identity();
    store.set(&format!("bench/exchange/host/{rank}"), host.as_bytes())?;
    if store.get(&format!("bench/exchange/host/{}", 1 - rank), wait)? != host.as_bytes() {
        return Ok(None);
    }
    let key = "bench/exchange/port";
    let sock = if rank == 0 {
        let l = TcpListener::bind("127.0.0.1:0").context("binding the exchange listener")?;
        l.set_nonblocking(true)?;
        store.set(key, l.local_addr()?.port().to_string().as_bytes())?;
        let deadline = Instant::now() + wait;
        loop {
            match l.accept() {
                Ok((s, _)) => break s,
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => {
                    return Err(e).context("waiting for rank 1 to connect to the exchange port");
                }
            }
        }
    } else {
        let port = String::from_utf8_lossy(&store.get(key, wait)?).into_owned();
        let port: u16 = port
            .parse()
            .with_context(|| format!("rank 0's exchange port {port:?}"))?;
        TcpStream::connect(("127.0.0.1", port))
            .with_context(|| format!("connecting to rank 0's exchange port 127.0.0.1:{port}"))?
    };
    let mut best = 0f64;
    for pages in Pages::ALL {
        let tx = PageBuf::new(bytes, 1, pages);
        let mut rx = PageBuf::new(bytes, 1, pages);
        for _ in 0..3 {
            pg.barrier()?;
            let mut t = [
                rsrun_examples::machine::tcp_exchange_secs(&sock, &tx, &mut rx)
                    .context("the two-way TCP exchange between the ranks")?,
            ];
            pg.all_reduce(&mut t, ReduceOp::Max)?;
            best = best.max(bytes as f64 / t[0] / 1e9);
        }
    }
    Ok(Some(best))
}

/// Large buffers on transparent huge pages, as in a trainer that installs rsrun's allocator
/// (`RSRUN_HUGE_PAGES=0` turns it off): the ops' buffers and the limits' alike.
#[global_allocator]
static ALLOC: rsrun_training_engine::hugepage::HugePageAlloc =
    rsrun_training_engine::hugepage::HugePageAlloc;

fn main() -> Result<()> {
    let args = parse_args()?;
    if let Some(n) = args.spawn {
        return spawn(n);
    }
    let rank = env_usize("RANK")?;
    let world = env_usize("WORLD_SIZE")?;
    // The temporary file-store directory this run created (removed at the end by rank 0).
    let mut temp_dir: Option<PathBuf> = None;
    let store: Arc<dyn rsrun_training_engine::comm::Store> =
        match (&args.store_dir, std::env::var_os("RSRUN_RDZV_ENDPOINT")) {
            (None, Some(_)) => {
                let ctx = rsrun_worker_runtime::WorkerContext::from_env()?;
                Arc::new(rsrun_worker_runtime::engine_store::EngineStore::new(&ctx)?)
            }
            (dir, _) => {
                let dir = match dir {
                    Some(d) => d.clone(),
                    None => {
                        let run =
                            std::env::var("TORCHELASTIC_RUN_ID").unwrap_or_else(|_| "none".into());
                        let port = std::env::var("MASTER_PORT").unwrap_or_else(|_| "0".into());
                        let d =
                            std::env::temp_dir().join(format!("collectives-bench-{run}-{port}"));
                        temp_dir = Some(d.clone());
                        d
                    }
                };
                Arc::new(FileStore::new(&dir)?)
            }
        };
    let mut out = std::io::stdout().lock();
    let mut results: BTreeMap<(String, String, usize), (f64, f64)> = BTreeMap::new();
    // (backend[:registered], op) → the fraction of its limit in each paired round at 64 MiB.
    let mut paired: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    // Physical limits, in this run: memcpy with every rank copying at once, over the same
    // footprint as the op (the in-place all_reduce's 64 MiB buffer: 32 MiB copied to 32 MiB;
    // reduce_scatter / all_gather: 64 + 64/N MiB), one TCP stream over loopback, and the
    // two-rank TCP exchange.
    let big = 64usize << 20;
    let (memcpy, loopback, exchange) = {
        let opts = CommOptions {
            timeout: Duration::from_secs(120),
            ..CommOptions::default()
        };
        let pg = ProcessGroup::new(rank, world, store.clone(), "bench/limits", opts)?;
        // Per footprint: the memcpy and the in-place fold figures; the limit is the better one.
        let mut bw = [0f64; 4];
        for (i, footprint) in [big, big + big / world].into_iter().enumerate() {
            pg.barrier()?;
            let (copy, fold) = rsrun_examples::machine::memory_gbps(footprint / 2);
            (bw[2 * i], bw[2 * i + 1]) = (copy, fold);
        }
        pg.all_reduce(&mut bw, ReduceOp::Min)?;
        pg.barrier()?;
        let loopback = if rank == 0 {
            rsrun_examples::machine::loopback_tcp_gbps(1 << 30)?
        } else {
            0.0
        };
        pg.barrier()?;
        let exchange = exchange_gbps(&pg, &*store, rank, big)?;
        (bw, loopback, exchange)
    };
    let exchange_txt = exchange.map_or("n/a".to_string(), |g| format!("{g:.2}"));
    let (copies, folds) = ([memcpy[0], memcpy[2]], [memcpy[1], memcpy[3]]);
    let memcpy = [copies[0].max(folds[0]), copies[1].max(folds[1])];
    let memcpy_for = |op: &str| {
        if op == "all_reduce" {
            memcpy[0]
        } else {
            memcpy[1]
        }
    };
    if rank == 0 {
        writeln!(out, "{}", rsrun_examples::machine::describe())?;
        writeln!(
            out,
            "limits: memcpy_gbps_per_rank={:.2} (64 MiB footprint) {:.2} ({} MiB footprint) fold_gbps_per_rank={:.2} {:.2} (read+write, all {world} ranks copying, or folding one buffer into another in place, at once; a bound uses the better) loopback_tcp_gbps={loopback:.2} (one stream) tcp_exchange_gbps={exchange_txt} (each way, {} MiB both ways at once between ranks 0 and 1 over loopback: a two-rank all_reduce's traffic with nothing else to do)",
            copies[0],
            copies[1],
            (big + big / world) >> 20,
            folds[0],
            folds[1],
            big >> 20
        )?;
    }
    for backend in &args.backends {
        let kind: BackendKind = backend.parse()?;
        let mut opts = CommOptions {
            backend: kind,
            timeout: Duration::from_secs(120),
            ..CommOptions::default()
        };
        if let Some(c) = args.chunk {
            opts.shm_chunk_bytes = c;
        }
        let pg = ProcessGroup::new(
            rank,
            world,
            store.clone(),
            &format!("bench/{backend}"),
            opts,
        )?;
        let name = pg.backend();
        for op in &args.ops {
            // Registered buffers only make a difference where the group has windows (shm), and
            // only for the ops with a zero-copy path (broadcast stages either way).
            let modes: &[bool] =
                if name == "shm" && matches!(op.as_str(), "all_reduce" | "all_gather" | "reduce_scatter") {
                    &[true, false]
                } else {
                    &[false]
                };
            for &bytes in &args.sizes {
                for &registered in modes {
                    let t = time_op(&pg, op, bytes, registered)?;
                    let algbw = bytes as f64 / t / 1e9;
                    let busbw = algbw * busbw_factor(op, world);
                    let buffers = if registered { "registered" } else { "plain" };
                    if rank == 0 {
                        writeln!(
                            out,
                            "op={op} backend={name} buffers={buffers} world={world} bytes={bytes} time_us={:.1} algbw_GBps={algbw:.3} busbw_GBps={busbw:.3}",
                            t * 1e6
                        )?;
                        out.flush()?;
                    }
                    let key = if registered {
                        format!("{backend}:registered")
                    } else {
                        backend.clone()
                    };
                    results.insert((key, op.clone(), bytes), (t, busbw));
                }
            }
            // Paired rounds at 64 MiB: the limit measured right before the op, round after
            // round, so that a slow spell of a shared host slows both sides of each ratio.
            if !args.sizes.contains(&big) || (name == "tcp" && op != "all_reduce") {
                continue;
            }
            for &registered in modes {
                let mut fracs = Vec::with_capacity(PAIRED_ROUNDS);
                for _ in 0..PAIRED_ROUNDS {
                    let limit = if name == "tcp" {
                        pg.barrier()?;
                        let mut lb = [if rank == 0 { rsrun_examples::machine::loopback_tcp_gbps(PAIRED_STREAM_BYTES)? } else { 0.0 }];
                        pg.broadcast(&mut lb, 0)?;
                        lb[0]
                    } else {
                        let mut bw = [memcpy_paired(&pg, op, big, world)?];
                        pg.all_reduce(&mut bw, ReduceOp::Min)?;
                        bw[0]
                    };
                    let t = time_op_iters(&pg, op, big, registered, 2, 6)?;
                    fracs.push(if name == "tcp" {
                        big as f64 / t * busbw_factor(op, world) / 1e9 / limit
                    } else {
                        traffic_bytes(op, big, world) / (limit * 1e9) / t
                    });
                }
                let key = if registered { format!("{backend}:registered") } else { backend.clone() };
                paired.insert((key, op.clone()), fracs);
            }
        }
        pg.barrier()?;
    }
    if rank == 0 {
        let get = |b: &str, op: &str, bytes: usize, us: bool| {
            results.get(&(b.to_string(), op.to_string(), bytes)).map_or(
                "n/a".to_string(),
                |(t, bw)| {
                    if us {
                        format!("{:.1}", t * 1e6)
                    } else {
                        format!("{bw:.3}")
                    }
                },
            )
        };
        let main = args
            .backends
            .iter()
            .find(|b| b.as_str() != "tcp")
            .cloned()
            .unwrap_or_else(|| "auto".into());
        // The headline figures use registered buffers where the backend has them (what the
        // engine's DDP gradients use); the plain-buffer (staged) fractions are printed too.
        let reg = format!("{main}:registered");
        let headline = |op: &str| {
            if results.contains_key(&(reg.clone(), op.to_string(), big)) {
                reg.clone()
            } else {
                main.clone()
            }
        };
        let frac_of = |b: &str, op: &str| match paired.get(&(b.to_string(), op.to_string())) {
            Some(f) => format!("{:.2}", rsrun_examples::median(f)),
            None => results.get(&(b.to_string(), op.to_string(), big)).map_or("n/a".to_string(), |(t, _)| {
                let bound = traffic_bytes(op, big, world) / (memcpy_for(op) * 1e9);
                format!("{:.2}", bound / t)
            }),
        };
        let frac = |op: &str| frac_of(&headline(op), op);
        for op in ["all_reduce", "reduce_scatter", "all_gather"] {
            for b in [reg.as_str(), main.as_str()] {
                if let Some((t, _)) = results.get(&(b.to_string(), op.to_string(), big)) {
                    let bound = traffic_bytes(op, big, world) / (memcpy_for(op) * 1e9);
                    writeln!(
                        out,
                        "bound: op={op} buffers={} bytes={big} traffic_per_rank={:.0} bound_us={:.1} measured_us={:.1} frac_of_first_limit={:.2} paired_rounds={} frac={}",
                        if b == reg { "registered" } else { "plain" },
                        traffic_bytes(op, big, world),
                        bound * 1e6,
                        t * 1e6,
                        bound / t,
                        rounds_text(paired.get(&(b.to_string(), op.to_string()))),
                        frac_of(b, op)
                    )?;
                }
            }
        }
        let tcp_bw = results.get(&("tcp".to_string(), "all_reduce".to_string(), big));
        let tcp_paired = paired.get(&("tcp".to_string(), "all_reduce".to_string()));
        let tcp_frac = match (tcp_paired, tcp_bw) {
            (Some(f), _) => format!("{:.2}", rsrun_examples::median(f)),
            (None, Some((_, bw))) => format!("{:.2}", bw / loopback),
            (None, None) => "n/a".to_string(),
        };
        if let Some((_, bw)) = tcp_bw {
            writeln!(
                out,
                "bound: op=all_reduce backend=tcp bytes={big} busbw_GBps={bw:.3} loopback_tcp_gbps={loopback:.2} frac_of_first_limit={:.2} paired_rounds={} frac={tcp_frac}",
                bw / loopback,
                rounds_text(tcp_paired)
            )?;
        }
        let tcp_exchange_frac = match (tcp_bw, exchange) {
            (Some((_, bw)), Some(d)) => format!("{:.2}", bw / d),
            _ => "n/a".to_string(),
        };
        writeln!(
            out,
            "summary: allreduce_frac_of_bound={} reduce_scatter_frac={} all_gather_frac={} tcp_frac_of_loopback={tcp_frac} allreduce_plain_frac={} reduce_scatter_plain_frac={} all_gather_plain_frac={} memcpy_gbps={:.2} loopback_tcp_gbps={loopback:.2} world={world} allreduce_64MiB_busbw_GBps={} allreduce_1KiB_us={} reduce_scatter_64MiB_busbw_GBps={} all_gather_64MiB_busbw_GBps={} tcp_allreduce_64MiB_busbw_GBps={} tcp_frac_of_exchange={tcp_exchange_frac} tcp_exchange_gbps={exchange_txt}",
            frac("all_reduce"),
            frac("reduce_scatter"),
            frac("all_gather"),
            frac_of(&main, "all_reduce"),
            frac_of(&main, "reduce_scatter"),
            frac_of(&main, "all_gather"),
            memcpy[0],
            get(&headline("all_reduce"), "all_reduce", big, false),
            get(&main, "all_reduce", 1 << 10, true),
            get(&headline("reduce_scatter"), "reduce_scatter", big, false),
            get(&headline("all_gather"), "all_gather", big, false),
            get("tcp", "all_reduce", big, false),
        )?;
        if let Some(dir) = &temp_dir {
            // Give the other ranks a moment to finish reading, then clean up the store.
            std::thread::sleep(Duration::from_millis(200));
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    Ok(())
}
