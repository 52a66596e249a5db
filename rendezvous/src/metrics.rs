//! Prometheus metrics of the service, served as text on `--metrics-listen`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of the RPC latency histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    /// RPC name.
    pub method: String,
    /// gRPC status code name (`Ok`, `NotFound`, ...).
    pub code: String,
}

fn rpc_histogram() -> Histogram {
    // 50 µs .. ~26 s.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 20))
}

/// Every metric the service exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// RPC latency by method and status.
    pub rpc: Family<RpcLabels, Histogram, fn() -> Histogram>,
    /// Jobs held.
    pub jobs: Gauge,
    /// Nodes held (all jobs).
    pub nodes: Gauge,
    /// Rounds formed.
    pub rounds_formed: Counter,
    /// Store keys (all jobs).
    pub store_keys: Gauge,
    /// Store bytes (all jobs).
    pub store_bytes: Gauge,
    /// Journal fsyncs.
    pub journal_syncs: Counter,
    /// Journal bytes written.
    pub journal_bytes: Counter,
    /// HA: 1 while this daemon leads.
    pub ha_leader: Gauge,
    /// HA: the epoch of the leader this daemon follows or is.
    pub ha_epoch: Gauge,
    /// HA: takeovers by this daemon.
    pub ha_failovers: Counter,
    /// HA: latency of one guarded log append (a Txn).
    pub ha_append_seconds: Histogram,
    /// HA: log bytes appended to etcd.
    pub ha_append_bytes: Counter,
    /// HA: entries a standby's replica is behind the newest log key it saw.
    pub ha_replica_lag_entries: Gauge,
    /// HA: time to write one snapshot's chunks and flip the pointer.
    pub ha_snapshot_seconds: Histogram,
    /// HA: seconds until this daemon's election lease may lapse (it self-fences before).
    pub ha_lease_remaining_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// HA: appends refused because the log slot held other bytes (a bug or a stale writer).
    pub ha_log_conflicts: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("rsrun_rendezvous");
        let rpc = Family::<RpcLabels, Histogram, fn() -> Histogram>::new_with_constructor(rpc_histogram as fn() -> Histogram);
        registry.register("rpc_duration_seconds", "RPC latency by method and status code", rpc.clone());
        let jobs = Gauge::default();
        registry.register("jobs", "Jobs held by the service", jobs.clone());
        let nodes = Gauge::default();
        registry.register("nodes", "Nodes held, over all jobs", nodes.clone());
        let rounds_formed = Counter::default();
        registry.register("rounds_formed", "Rounds formed", rounds_formed.clone());
        let store_keys = Gauge::default();
        registry.register("store_keys", "Store keys, over all jobs", store_keys.clone());
        let store_bytes = Gauge::default();
        registry.register("store_bytes", "Store bytes (keys plus values), over all jobs", store_bytes.clone());
        let journal_syncs = Counter::default();
        registry.register("journal_syncs", "Journal fsyncs", journal_syncs.clone());
        let journal_bytes = Counter::default();
        registry.register("journal_bytes", "Journal bytes written", journal_bytes.clone());
        let ha_leader = Gauge::default();
        registry.register("ha_leader", "1 while this daemon is the HA leader", ha_leader.clone());
        let ha_epoch = Gauge::default();
        registry.register("ha_epoch", "Epoch (fencing token) of the HA leader this daemon is or follows", ha_epoch.clone());
        let ha_failovers = Counter::default();
        registry.register("ha_failovers", "Takeovers by this daemon", ha_failovers.clone());
        let ha_append_seconds = rpc_histogram();
        registry.register("ha_append_seconds", "Latency of one guarded etcd log append", ha_append_seconds.clone());
        let ha_append_bytes = Counter::default();
        registry.register("ha_append_bytes", "Log bytes appended to etcd", ha_append_bytes.clone());
        let ha_replica_lag_entries = Gauge::default();
        registry.register("ha_replica_lag_entries", "Entries the standby replica is behind the log it saw", ha_replica_lag_entries.clone());
        let ha_snapshot_seconds = rpc_histogram();
        registry.register("ha_snapshot_seconds", "Time to write a snapshot to etcd and flip its pointer", ha_snapshot_seconds.clone());
        let ha_lease_remaining_seconds = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register("ha_lease_remaining_seconds", "Seconds until the election lease may lapse", ha_lease_remaining_seconds.clone());
        let ha_log_conflicts = Counter::default();
        registry.register("ha_log_conflicts", "Log appends refused because the slot held other bytes", ha_log_conflicts.clone());
        Metrics {
            registry,
            rpc,
            jobs,
            nodes,
            rounds_formed,
            store_keys,
            store_bytes,
            journal_syncs,
            journal_bytes,
            ha_leader,
            ha_epoch,
            ha_failovers,
            ha_append_seconds,
            ha_append_bytes,
            ha_replica_lag_entries,
            ha_snapshot_seconds,
            ha_lease_remaining_seconds,
            ha_log_conflicts,
        }
    }
}

impl Metrics {
    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Records one RPC.
    pub fn observe(&self, method: &str, code: tonic::Code, seconds: f64) {
        self.rpc.get_or_create(&RpcLabels { method: method.to_string(), code: format!("{code:?}") }).observe(seconds);
    }
}
