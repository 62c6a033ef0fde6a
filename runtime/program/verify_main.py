"""`program.py --verify SPEC.json [--result FILE]`: one rank of a verification run."""

from __future__ import annotations


def run_verify_rank(directory: str, args) -> int:
    from shardbound.runtime.parallel import dist
    from shardbound.runtime.program.loader import load
    from shardbound.runtime.program.report import write_output
    from shardbound.runtime.verification.spec import read_spec
    from shardbound.runtime.verification.verdict import verify

    spec = read_spec(args.verify)
    with dist.rank_session(args.threads, args.timeout, getattr(args, "device", "cpu")) as comm:
        verifier = load(directory, comm=comm)
        result = verify(verifier, spec, args.verify_timeout, comm, quiet=args.quiet or comm.rank != 0)
        comm.barrier()
    if comm.rank != 0:
        return 0
    print(result.verdict)
    if not args.quiet:
        print(f"# {spec.source}: {result.verdict} in {result.seconds:.2f} s "
              f"({', '.join(result.stages) or 'no bounding needed'})")
    if args.result:
        write_output(args.result, result.vnncomp_text())
    return 0
