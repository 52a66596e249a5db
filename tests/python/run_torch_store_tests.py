"""Runs PyTorch's own TCPStore tests against a TCPStore server.

The tests are torch's files, unmodified (torch_store_tests/: test/distributed/test_store.py and
the c10d rendezvous backend tests of PyTorch v2.6.0; see torch_store_tests/README.md for where they
come from). This runner selects the tests that exercise a TCPStore *server* through torch's client
(tcpstore.md §6.1) and, with `--server rsrun`, points them at rsrun's server with the small patch
that section describes, applied at run time instead of by editing the files:

- `create_tcp_store` (torch's test helper, which makes a master store on a free port) returns a
  plain client (`is_master=False`) of a new `rsrun-rendezvous tcpstore` process: every store a test
  asks for is a fresh, empty keyspace, as under rsrun every job attempt gets one;
- `find_free_port` (used by the env:// and tcp:// rendezvous tests) starts a new rsrun store and
  returns its port, exported as MASTER_PORT with TORCHELASTIC_USE_AGENT_STORE=True (and MASTER_ADDR
  equal to the URL's host), so torch's rendezvous makes every rank a client of it, exactly as under
  `rsrun` or torchrun with the agent store;
- `TCPStoreBackendTest.setUpClass` (torchrun's c10d rendezvous backend, CAS semantics) uses a
  client of an rsrun store instead of `TCPStore(..., is_master=True)`.

With `--server torch` the same tests run unpatched on torch's own servers: the reference that shows
the selection passes with this torch version (a test that fails there is retried once, alone:
`retry_reference_failures` says why).

Usage: python run_torch_store_tests.py --server rsrun|torch [--rendezvous PATH]
Ends with a line "N passed, N failed"; exits non-zero when a test failed or none ran.
"""

import argparse
import atexit
import os
import subprocess
import sys
import unittest
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS_DIR = os.path.join(HERE, "torch_store_tests")

# The applicable subset (tcpstore.md §6.1), by class.
SELECTED = {
    "test_store.TCPStoreTest": [
        "test_set_get_check",
        "test_compare_set",
        "test_simple_wait",
        "test_append",
        "test_multi_set",
        "test_multi_get",
        "test_numkeys_delkeys",
        "test_multi_worker_with_fixed_world_size",
        "test_multi_worker_with_nonfixed_world_size",
        "test_world_size_0_raises",
    ],
    "test_store.PrefixTCPStoreTest": [
        "test_set_get_check",
        "test_compare_set",
        "test_simple_wait",
        "test_append",
        "test_multi_set",
        "test_multi_get",
        "test_underlying_non_prefix_store",
    ],
    "test_store.TestMultiThreadedWait": ["test_wait_tcp_store", "test_wait_tcp_store_uv"],
    "test_store.RendezvousEnvTest": ["test_nominal"],
    "test_store.RendezvousTCPTest": [
        "test_nominal",
        "test_tcp_store_timeout_set",
        "test_tcp_store_timeout_doest_break_client",
    ],
    "c10d_rendezvous_backend_test.TCPStoreBackendTest": [
        "test_get_state_returns_backend_state",
        "test_get_state_returns_none_if_backend_state_does_not_exist",
        "test_get_state_raises_error_if_backend_state_is_corrupt",
        "test_set_state_sets_backend_state_if_it_does_not_exist",
        "test_set_state_sets_backend_state_if_token_is_current",
        "test_set_state_returns_current_backend_state_if_token_is_old",
        "test_set_state_returns_current_backend_state_if_token_is_none",
        "test_set_state_returns_current_backend_state_if_token_is_invalid",
    ],
}
# LibUvTCPStoreTest repeats TCPStoreTest with torch's libuv client flag.
SELECTED["test_store.LibUvTCPStoreTest"] = SELECTED["test_store.TCPStoreTest"]

# Not selected, and why (tcpstore.md §6.1): they test torch's in-process server (binding a port,
# master_listen_fd, waiting for workers, multi-tenancy, the server half of repr), or no TCPStore
# server at all (file/hash/python stores, URL parsing, DNS errors, a fake server checking the
# client's bytes). TimeoutTest.test_interrupt_doesnt_break_wait builds its master store with
# dist.TCPStore directly, so it cannot be pointed elsewhere without editing it.
NOT_APPLICABLE = (
    "TCPStoreTest/LibUvTCPStoreTest: test_address_already_in_use, test_multitenancy, test_repr, "
    "test_init_pg_and_rpc_with_same_socket, test_take_over_listen_socket, "
    "test_store_timeout_on_missing_clients; TimeoutTest; File/Hash/Python/Prefix-file stores; "
    "RendezvousTest, RendezvousFileTest; RendezvousTCPTest.test_common_errors/test_dns_timeout/"
    "test_tcp_store_url_with_libuv; InitPgWithNonUvStore; TestClientProtocol; CreateBackendTest"
)


class RsrunStores:
    """`rsrun-rendezvous tcpstore` processes, one per store asked for, all ended at exit."""

    def __init__(self, binary):
        self.binary = binary
        self.procs = []
        atexit.register(self.close)

    def new_port(self):
        proc = subprocess.Popen(
            [self.binary, "tcpstore", "--listen", "127.0.0.1:0", "--print-port"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.procs.append(proc)
        line = proc.stdout.readline().strip()
        if not line.isdigit():
            raise RuntimeError(f"{self.binary} tcpstore printed {line!r}, not a port")
        return int(line)

    def close(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


def patch_for_rsrun(binary):
    """Points torch's test helpers at rsrun stores. Must run before the test modules are imported
    (they import `create_tcp_store` by name, and TestMultiThreadedWait makes stores in its class
    body)."""
    import torch.distributed as dist
    import torch.testing._internal.common_distributed as common_distributed
    import torch.testing._internal.common_utils as common_utils

    stores = RsrunStores(binary)
    made = []

    def create_tcp_store(
        addr="localhost",
        world_size=1,
        is_master=True,
        timeout=timedelta(minutes=5),
        wait_for_workers=True,
        jit_class=False,
        use_libuv=True,
    ):
        assert not jit_class, "no selected test uses the TorchScript store class"
        port = stores.new_port()
        store = dist.TCPStore(
            addr, port, world_size, False, timeout=timeout, wait_for_workers=wait_for_workers, use_libuv=use_libuv
        )
        made.append(port)
        return store

    def find_free_port():
        port = stores.new_port()
        os.environ["MASTER_PORT"] = str(port)
        made.append(port)
        return port

    common_distributed.create_tcp_store = create_tcp_store
    common_utils.find_free_port = find_free_port
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return stores, made


def load_suite(rsrun_stores):
    sys.path.insert(0, TESTS_DIR)
    import c10d_rendezvous_backend_test
    import test_store
    from torch.distributed import TCPStore

    if rsrun_stores is not None:
        # The tcp:// tests use torch's DEFAULT_HOSTNAME in the URL: the agent store is the one at
        # MASTER_ADDR:MASTER_PORT, so MASTER_ADDR names that host (RendezvousEnvTest sets its own).
        tcp_setup = test_store.RendezvousTCPTest.setUp

        def setUp(self):
            os.environ["MASTER_ADDR"] = test_store.DEFAULT_HOSTNAME
            tcp_setup(self)

        test_store.RendezvousTCPTest.setUp = setUp

        @classmethod
        def setUpClass(cls):
            cls._store = TCPStore("localhost", rsrun_stores.new_port(), is_master=False)

        c10d_rendezvous_backend_test.TCPStoreBackendTest.setUpClass = setUpClass

    modules = {"test_store": test_store, "c10d_rendezvous_backend_test": c10d_rendezvous_backend_test}
    suite = unittest.TestSuite()
    for qualified, names in SELECTED.items():
        module, cls = qualified.split(".")
        klass = getattr(modules[module], cls)
        for name in names:
            suite.addTest(klass(name))
    return suite


def retry_reference_failures(result):
    """The reference run (torch's own servers) retries each failed test once, alone.

    torch's own non-libuv server loses a wake-up now and then: TestMultiThreadedWait.test_wait_tcp_store
    times out in its 2 s wait although rank 1 set the key, about once in 100-300 runs when other
    processes load the cores (as the rest of the test suite does). On rsrun's server the same test
    passed 300 of 300 under the same load. The reference only shows that the selection passes with
    this torch version, so a test that passes on its retry counts as passed there; the run against
    rsrun's server never retries.
    """
    for kind in (result.errors, result.failures):
        for test, trace in list(kind):
            again = unittest.TestSuite([type(test)(test._testMethodName)])
            retry = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(again)
            if retry.wasSuccessful():
                kind.remove((test, trace))
                print(f"passed on its retry (reference run only): {test.id()}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", choices=["rsrun", "torch"], required=True)
    ap.add_argument("--rendezvous", default=os.environ.get("RSRUN_RENDEZVOUS"), help="rsrun-rendezvous binary")
    args = ap.parse_args()
    # torch's test utilities parse sys.argv when imported.
    sys.argv = sys.argv[:1]
    stores, made = None, []
    if args.server == "rsrun":
        if not args.rendezvous:
            ap.error("--server rsrun needs --rendezvous or RSRUN_RENDEZVOUS")
        stores, made = patch_for_rsrun(args.rendezvous)
    suite = load_suite(stores)
    print(f"running {suite.countTestCases()} of torch's store tests against the {args.server} server", flush=True)
    print(f"not applicable to an external server: {NOT_APPLICABLE}", flush=True)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    if args.server == "torch":
        retry_reference_failures(result)
    if stores is not None:
        stores.close()
        print(f"rsrun stores started for the tests: {len(made)}")
    ran = result.testsRun - len(result.skipped)
    failed = len(result.failures) + len(result.errors)
    skipped = f", {len(result.skipped)} skipped" if result.skipped else ""
    print(f"{ran - failed} passed, {failed} failed{skipped}")
    # Every selected test applies: a skip would hide a server that was never exercised.
    sys.exit(0 if failed == 0 and ran > 0 and not result.skipped and (stores is None or made) else 1)


if __name__ == "__main__":
    main()
