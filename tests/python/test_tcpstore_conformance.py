"""TCPStore conformance: torch's real client against a TCPStore server.

Every test runs twice: against torch's own libuv server (the reference: an expectation that fails
there is wrong) and against rsrun's server (`rsrun-rendezvous tcpstore`, one process per test, so
every test gets a fresh, empty keyspace). The cases restate the applicable tests of torch's
`test/distributed/test_store.py` (v2.15.0; see ../shared/reference/tcpstore.md §6.1), written
against the documented behaviour, plus rendezvous through `env://` and `tcp://` with
TORCHELASTIC_USE_AGENT_STORE=True as torchrun's workers do it.

Environment: RSRUN_RENDEZVOUS = path of the rsrun-rendezvous binary.
Run: python -m pytest -q tests/python/test_tcpstore_conformance.py
"""

import datetime
import os
import signal
import subprocess
import threading
import time

import pytest
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=20)
SHORT = datetime.timedelta(milliseconds=300)


class RsrunServer:
    def __init__(self):
        binary = os.environ["RSRUN_RENDEZVOUS"]
        self.proc = subprocess.Popen(
            [binary, "tcpstore", "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline().strip()
        if not line:
            self.proc.kill()
            raise RuntimeError("rsrun-rendezvous tcpstore printed no address")
        # "127.0.0.1:PORT", "listening on 127.0.0.1:PORT" or a bare port.
        self.port = int(line.rsplit(":", 1)[-1].split()[-1])

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class TorchServer:
    def __init__(self):
        self.store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=TIMEOUT, wait_for_workers=False, use_libuv=True)
        self.port = self.store.port

    def close(self):
        del self.store


@pytest.fixture(params=["torch", "rsrun"])
def server(request):
    s = TorchServer() if request.param == "torch" else RsrunServer()
    yield s
    s.close()


def client(server, timeout=TIMEOUT, world_size=1, wait_for_workers=True):
    """A plain client, as every worker is under TORCHELASTIC_USE_AGENT_STORE=True."""
    return dist.TCPStore(
        "127.0.0.1", server.port, world_size, False, timeout=timeout, wait_for_workers=wait_for_workers, use_libuv=True
    )


def test_set_get_check_num_keys(server):
    s = client(server)
    for d in (1, 2, 3):
        s.add("key", d)
    s.set("key0", "value0")
    s.add("key3", 1)
    s.set("key1", "value1")
    s.add("key3", 2)
    s.set("key2", "value2")
    assert s.get("key") == b"6"
    assert s.get("key0") == b"value0"
    assert s.get("key1") == b"value1"
    assert s.get("key2") == b"value2"
    assert s.get("key3") == b"3"
    assert s.check(["key3"])
    assert not s.check(["Randomkey3"])
    s.set("-key3", "7")
    assert s.get("-key3") == b"7"
    assert s.delete_key("-key3")
    # key, key0..key3 and the client's "init/" counter.
    assert s.num_keys() == 6


def test_add_negative_and_parse(server):
    s = client(server)
    assert s.add("ctr", 5) == 5
    assert s.add("ctr", -7) == -2
    assert s.get("ctr") == b"-2"
    s.set("lead", " 12abc")
    # std::stoll semantics: leading space, trailing garbage ignored.
    assert s.add("lead", 1) == 13


def test_compare_set(server):
    s = client(server)
    # Missing key, expected "": created.
    assert s.compare_set("cs", "", "first") == b"first"
    # Present, wrong expected: the current value, unchanged.
    assert s.compare_set("cs", "wrong", "x") == b"first"
    # Present, right expected: swapped.
    assert s.compare_set("cs", "first", "second") == b"second"
    assert s.get("cs") == b"second"
    # Missing key with a non-empty expected: the reply echoes `expected` and nothing is created.
    assert s.compare_set("missing", "old", "new") == b"old"
    assert not s.check(["missing"])


def test_simple_wait_times_out_and_connection_stays_usable(server):
    s = client(server)
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        s.wait(["never"], SHORT)
    assert time.monotonic() - t0 < 10
    assert "wait timeout" in str(err.value) or "Timeout" in type(err.value).__name__, err.value
    s.set("after", "ok")
    assert s.get("after") == b"ok"


def test_get_timeout_message_names_the_key(server):
    s = client(server, timeout=datetime.timedelta(milliseconds=100))
    with pytest.raises(Exception) as err:
        s.get("nonexistent key")
    assert "wait timeout after 100ms" in str(err.value) and "/nonexistent key" in str(err.value), err.value
    s.set("k", "v")
    assert s.get("k") == b"v"


def test_append_multi_set_multi_get(server):
    s = client(server)
    s.set("a", "po")
    s.append("a", "tato")
    s.append("fresh", "x")
    assert s.get("a") == b"potato"
    assert s.get("fresh") == b"x"
    s.multi_set(["m1", "m2", "m3"], ["x", "yy", ""])
    assert s.multi_get(["m1", "m2", "m3"]) == [b"x", b"yy", b""]


def test_delete_key_and_get_of_deleted_times_out(server):
    s = client(server, timeout=datetime.timedelta(seconds=1))
    s.set("d", "v")
    assert s.num_keys() == 2
    assert s.delete_key("d")
    assert not s.delete_key("d")
    assert s.num_keys() == 1
    with pytest.raises(Exception):
        s.get("d")


def test_list_keys(server):
    s = client(server)
    s.set("x", "1")
    s.add("y", 1)
    # The client drops the raw "init/" key and strips the leading "/".
    assert sorted(s.list_keys()) == ["x", "y"]


def test_queues(server):
    s = client(server)
    s.queue_push("q", "a")
    s.queue_push("q", b"b")
    assert s.queue_len("q") == 2
    assert s.check(["q"])
    assert s.queue_pop("q") == b"a"
    assert s.queue_pop("q", block=False) == b"b"
    assert s.queue_len("q") == 0
    with pytest.raises(Exception):
        s.queue_pop("q", block=False)
    # Queues are a namespace of their own: not KV keys.
    assert s.num_keys() == 1


def test_queue_blocking_pop_across_a_clone(server):
    s = client(server)
    other = s.clone()
    got = []
    t = threading.Thread(target=lambda: got.append(other.queue_pop("work")))
    t.start()
    time.sleep(0.2)
    s.queue_push("work", "item")
    t.join(10)
    assert got == [b"item"]


def test_queue_pop_times_out(server):
    s = client(server, timeout=SHORT)
    with pytest.raises(Exception):
        s.queue_pop("empty")
    s.set("still", "usable")
    assert s.get("still") == b"usable"


def test_multi_key_wait_needs_every_key(server):
    # torch's libuv server wakes this wait after two pushes to one queue; a correct server does not.
    if isinstance(server, TorchServer):
        pytest.skip("torch's libuv server has the bug this test guards against (tcpstore.md §4.6)")
    s = client(server)
    other = s.clone()
    s.queue_push("q", "1")
    s.queue_push("q", "2")
    with pytest.raises(Exception):
        other.wait(["q", "r"], SHORT)


def test_clone_sees_the_same_keyspace(server):
    s = client(server)
    c = s.clone()
    s.set("shared", "1")
    assert c.get("shared") == b"1"


def test_wait_is_woken_from_another_connection(server):
    s = client(server)
    other = s.clone()

    def later():
        time.sleep(0.2)
        other.set("k1", "v")

    t = threading.Thread(target=later)
    t.start()
    s.wait(["k1"], datetime.timedelta(seconds=10))
    t.join()
    assert s.get("k1") == b"v"


def test_wait_is_woken_by_a_creating_compare_set_only(server):
    s = client(server)
    other = s.clone()
    if isinstance(server, RsrunServer):
        # A failed CAS on a missing key changes nothing and must not wake (libuv's bug).
        other.compare_set("c", "not-there", "x")
        with pytest.raises(Exception):
            s.wait(["c"], SHORT)
    threading.Timer(0.2, lambda: other.compare_set("c", "", "made")).start()
    s.wait(["c"], datetime.timedelta(seconds=10))
    assert s.get("c") == b"made"


def test_barrier_and_reused_key(server):
    s = client(server)
    c = s.clone()
    done = []
    t = threading.Thread(target=lambda: (c.barrier("b", 2, TIMEOUT), done.append(1)))
    t.start()
    time.sleep(0.2)
    assert not done, "a barrier of 2 passed with 1 arrival"
    s.barrier("b", 2, TIMEOUT)
    t.join(10)
    assert done
    # The counter is never reset: a reused key passes at once.
    s.barrier("b", 2, TIMEOUT)


def test_prefix_store(server):
    s = client(server)
    p = dist.PrefixStore("pfx", s)
    p.set("k", "v")
    assert p.get("k") == b"v"
    assert s.get("pfx/k") == b"v"
    assert p.add("n", 3) == 3


def test_many_workers_count_and_compare_set(server):
    n, per = 8, 50
    stores = [client(server, world_size=1) for _ in range(n)]

    def work(st):
        for _ in range(per):
            st.add("counter", 1)
        st.compare_set("winner", "", "me")

    threads = [threading.Thread(target=work, args=(st,)) for st in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert stores[0].get("counter") == str(n * per).encode()
    assert stores[0].get("winner") == b"me"


def test_world_size_workers_meet_at_init(server):
    # world_size=3 clients each ADD "init/" and wait until three arrived.
    out = []

    def worker():
        st = client(server, world_size=3, wait_for_workers=True)
        out.append(st.num_keys())

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(out) == 3


def test_interrupt_does_not_break_a_wait(server):
    s = client(server)
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(Exception):
            s.wait(["absent"], datetime.timedelta(milliseconds=500))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    s.set("alive", "1")
    assert s.get("alive") == b"1"


@pytest.mark.parametrize("init", ["env", "tcp"])
def test_init_process_group_through_the_agent_store(server, init, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    if init == "env":
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        url = "env://"
    else:
        url = f"tcp://127.0.0.1:{server.port}?rank=0&world_size=1"
    store, rank, world = next(dist.rendezvous(url, timeout=TIMEOUT))
    assert (rank, world) == (0, 1)
    store.set("through", "agent store")
    assert client(server).get("through") == b"agent store"
