"""Run the dsv41-convert CLI with another copy step: `python bench/with_chunk.py MIB shard SRC OUT ...`.

Sets `execute`'s chunk_bytes default to MIB MiB before the CLI parses its arguments (the step reaches the
workers in their job); computed row chunks follow it (write.COMPUTE_CHUNKS copy steps). For
bench_shard_cpu.py --chunk-mib: copy steps compared in one process tree, the same code otherwise.
"""

import sys

if __name__ == "__main__":  # the workers' processes import this file again as their main module
    from dsv41_convert.cli import main
    from dsv41_convert.convert import execute

    execute.execute.__kwdefaults__["chunk_bytes"] = int(sys.argv[1]) << 20
    sys.argv = ["dsv41-convert", *sys.argv[2:]]
    main()
