"""What a generated torchrun repro script runs before it joins its group
(keep the group's sockets on loopback) and how it leaves (``ENTRY``).

A repro is run by whoever got the findings file, often on a shared or
networked machine. torchrun's default rendezvous and gloo's pairs otherwise
listen on an address other hosts can reach (gloo takes the hostname's). The
script pins both to the loopback interface and refuses a MASTER_ADDR that is
not loopback, unless the user sets GRADFUZZ_REPRO_ANY_INTERFACE=1 (a run
across hosts, which then needs its own interface settings).
"""

from __future__ import annotations

RUN = "torchrun --master-addr 127.0.0.1 --nproc-per-node {world_size} THIS_FILE"

SOURCE = '''def _gradfuzz_loopback():
    """Keep this script's sockets on loopback (GRADFUZZ_REPRO_ANY_INTERFACE=1: leave them to the user)."""
    if os.environ.get("GRADFUZZ_REPRO_ANY_INTERFACE") == "1":
        return
    import socket

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if addr not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"MASTER_ADDR={addr} is not loopback: run with --master-addr 127.0.0.1, "
                 "or set GRADFUZZ_REPRO_ANY_INTERFACE=1 to run across hosts")
    lo = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if lo:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
'''

# How a ranked script starts its group, compares one grad and gives its
# verdict (DeepSpeed, megatron): nccl with a GPU per rank, else gloo; a grad a stack's flat buffers hold as zeros for a parameter
# that got none is read as zeros, on either side; every rank's count of
# differences is summed, rank 0 prints the verdict, and the ranks leave
# together (ENTRY). The absolute tolerance scales with the grad's largest
# element: float32 rounding in a sum is of the size of its largest terms, and
# an element that cancels to 52.9 in a grad whose largest is 6287 was 0.0018
# off on a drawn deepspeed.pipe case (1e-5 flat called that a divergence);
# the bugs these scripts show are of order one.
VERDICT = '''def start_group(world, **init):
    """This rank's process group: nccl with a GPU per rank, else gloo on the CPU. (rank, device, gpus)."""
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world
    dist.init_process_group("nccl" if gpus else "gloo", **init)
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    return rank, device, gpus


def differs(rank, k, name, e, a, shape):
    """1 (and what differs, printed) when grad ``a`` is not eager's ``e``; None reads as zeros."""
    e = torch.zeros(shape, dtype=torch.float64) if e is None else e
    a = torch.zeros(shape, dtype=torch.float64) if a is None else a.to("cpu", torch.float64)
    if torch.allclose(a, e, rtol=1e-5, atol=1e-5 * max(1.0, float(e.abs().max()) if e.numel() else 1.0)):
        return 0
    print(f"rank {rank} backward {k}: {name}.grad differs\\n  expected {e.tolist()}\\n  actual   {a.tolist()}")
    return 1


def verdict(bad, device, versions):
    flag = torch.tensor([bad], device=device)
    dist.all_reduce(flag)
    if dist.get_rank() == 0:
        print(f"{versions}: {'DIVERGES' if flag.item() else 'agrees'} ({int(flag.item())} differences)")
    dist.barrier()  # no rank tears gloo down while another is still using it (an abort at exit)
    dist.destroy_process_group()
    return 1 if flag.item() else 0
'''

# The verdict is flushed, then the interpreter's teardown is skipped.
ENTRY = '''

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: in the interpreter's teardown gloo's threads sometimes abort
    # the process (SIGABRT, "terminate called without an active exception", even
    # after destroy_process_group), and the exit status would be the abort's.
    os._exit(code)
'''
