"""How long a long text prompt stalls the router's event loop while it is tokenized.

The router tokenizes text prompts on a two-thread pool (``Router.tokenize``); every stream the
router serves runs on its one asyncio loop, so a tokenization on the loop would hold every
stream's next token for as long as it takes. This measures the loop's largest stall (a 1 ms
ticker's worst lateness) while the longest text the byte bound lets through is tokenized:

  idle (5 ms)      nothing but a 5 ms sleep: the ticker's own lateness, for scale
  on the loop      ``tokenizer.encode`` called from a coroutine
  pool, encode     ``tokenizer.encode`` on the thread pool: the GIL is held all the same
  pool, batch      ``tokenizer.encode_batch([text])`` on the pool, as ``Router.tokenize``
                   does: tokenizers releases the GIL in ``encode_batch`` only

Both with the built-in model's tokenizer (or ``--model DIR``); the text is ``--words`` words, or
by default as many as ``max_prompt_bytes`` allows for ``--max-input-len`` tokens. Prints the
figures and their ratio.

Run: ``.venv/bin/python benchmarks/router_loop.py [--max-input-len 2048] [--reps 5]``.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

TICK_S = 0.001


async def _worst_stall(work) -> tuple[float, float]:
    """(worst ticker lateness in ms, seconds the work took) while ``work()`` runs."""
    stop = asyncio.Event()
    worst = 0.0

    async def ticker() -> None:
        nonlocal worst
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(TICK_S)
            worst = max(worst, time.perf_counter() - t0 - TICK_S)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)  # the ticker is running
    t0 = time.perf_counter()
    await work()
    took = time.perf_counter() - t0
    await asyncio.sleep(0.01)
    stop.set()
    await task
    return worst * 1000, took


def main() -> None:
    from pdserve.cluster.launch import builtin_model_dir
    from pdserve.cluster.router.core import TEXT_THREADS, longest_token_bytes
    from pdserve.workers.loading.loader import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model directory (default: the built-in tiny model)")
    ap.add_argument("--max-input-len", type=int, default=2048)
    ap.add_argument("--words", type=int, default=0, help="words of text (default: the byte bound)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    tokenizer = load_tokenizer(args.model or str(builtin_model_dir()))
    max_bytes = args.max_input_len * longest_token_bytes(tokenizer)
    words = args.words or max(1, max_bytes // len("hello "))
    text = ("hello " * words)[:max_bytes] if not args.words else "hello " * words
    pool = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="bench-tokenize")

    def encode() -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    async def on_loop() -> None:
        encode()

    async def on_pool() -> None:
        nbytes = len(text.encode("utf-8", "surrogatepass"))  # the byte bound, as the router does
        assert nbytes <= max_bytes or args.words
        await asyncio.get_running_loop().run_in_executor(pool, encode)

    def encode_batch() -> list[int]:  # tokenizers releases the GIL in encode_batch only
        return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    async def on_pool_batch() -> None:
        await asyncio.get_running_loop().run_in_executor(pool, encode_batch)

    async def idle() -> None:  # the ticker's own lateness, for scale
        await asyncio.sleep(0.005)

    async def run() -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {"idle (5 ms)": [], "on the loop": [],
                                                     "pool, encode": [], "pool, batch": []}
        await on_pool()  # warm both paths once
        for _ in range(args.reps):
            out["idle (5 ms)"].append(await _worst_stall(idle))
            out["on the loop"].append(await _worst_stall(on_loop))
            out["pool, encode"].append(await _worst_stall(on_pool))
            out["pool, batch"].append(await _worst_stall(on_pool_batch))
        return out

    results = asyncio.run(run())
    ntokens = len(encode())
    print(f"text: {len(text.encode())} bytes, {ntokens} tokens (byte bound {max_bytes} for "
          f"max_input_len {args.max_input_len}); {args.reps} reps, 1 ms ticker")
    print(f"{'':14s} {'loop stall ms (median / max)':>30s} {'encode ms (median)':>20s}")
    med = {}
    for name, rows in results.items():
        stalls = [s for s, _ in rows]
        med[name] = statistics.median(stalls)
        print(f"{name:14s} {med[name]:14.2f} / {max(stalls):8.2f} "
              f"{statistics.median(t for _, t in rows) * 1000:20.2f}")
    print(f"ratio (on the loop / pool, batch), median stall: "
          f"{med['on the loop'] / max(med['pool, batch'], 1e-6):.1f}x")
    pool.shutdown()


if __name__ == "__main__":
    main()
