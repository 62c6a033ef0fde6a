"""`program.py --verify SPEC.json [--result FILE]`: one rank of a verification run."""

from __future__ import annotations

import torch

from shardbound.runtime.errors import ShardboundError


def run_verify_rank(directory: str, args) -> int:
    from shardbound.runtime import dist
    from shardbound.runtime.loader import load
    from shardbound.runtime.spec import read_spec
    from shardbound.runtime.verify import verify

    torch.set_num_threads(args.threads)
    spec = read_spec(args.verify)
    comm = dist.from_environment(timeout_s=args.timeout, device=getattr(args, "device", "cpu"))
    try:
        verifier = load(directory, comm=comm)
        result = verify(verifier, spec, args.verify_timeout, comm, quiet=args.quiet or comm.rank != 0)
        comm.barrier()
    finally:
        if comm.world == 1:
            comm.close()
    if comm.rank != 0:
        return 0
    print(result.verdict)
    if not args.quiet:
        print(f"# {spec.source}: {result.verdict} in {result.seconds:.2f} s "
              f"({', '.join(result.stages) or 'no bounding needed'})")
    if args.result:
        try:
            with open(args.result, "w", encoding="utf-8") as f:
                f.write(result.vnncomp_text())
        except OSError as e:
            raise ShardboundError(f"{args.result}: cannot write the result ({e.strerror})") from None
    return 0
