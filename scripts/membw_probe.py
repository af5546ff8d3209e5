"""Host memory-copy bandwidth (bytes read + written) with 1..16 threads, each copying a
256 MiB buffer of its own: the ceiling for memory-bound CPU collectives on this host."""

import threading
import time

import torch

N = 1 << 28
REPS = 4


def main() -> None:
    torch.set_num_threads(1)  # one copy per Python thread, each on one core
    for threads in (1, 2, 4, 8, 16):
        pairs = [(torch.ones(N, dtype=torch.uint8), torch.empty(N, dtype=torch.uint8))
                 for _ in range(threads)]
        for src, dst in pairs:
            dst.copy_(src)  # pages faulted in before timing

        def run(src: torch.Tensor, dst: torch.Tensor) -> None:
            for _ in range(REPS):
                dst.copy_(src)

        workers = [threading.Thread(target=run, args=p) for p in pairs]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - start
        print(f"memcpy {threads:2d} threads: {2 * N * REPS * threads / seconds / 1e9:6.1f} GB/s "
              "(read + write)", flush=True)
        del pairs


if __name__ == "__main__":
    main()
