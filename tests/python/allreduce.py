# gloo all_reduce with an unmodified init_process_group (env://): every rank checks the sum.
# Used by the e2e torch test (tests/tests/e2e/torch.rs) and scripts/test-wheel.sh.
import os, torch, torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    ws = dist.get_world_size()
    assert t.item() == ws * (ws + 1) / 2, t
    print(f"allreduce ok rank={dist.get_rank()} world={ws} sum={t.item()}", flush=True)
    dist.destroy_process_group()

main()
