"""Router prefix index (``cluster/prefix_index.py``): cost per KV event, per request scored, and
memory, at 10^5 and 10^6 cached blocks (total over workers) across 8 and 64 workers.

Workload: a few hundred system prompts (8-32 blocks, Zipf-like popularity) open chat
conversations; each request extends a conversation by a turn (4-24 blocks, up to 160 blocks in
all) and goes to the conversation's home worker (3 in 4) or to a random one. The worker stores
the part of the prompt it does not hold as one ``BlocksStored``, as its radix tree would; events
reach the index in batches of 8 per worker. Keys are 16-byte chained digests, and every event
carries its own copies of them, as decoded off the wire.

Figures, per configuration:
- store: µs per block stored, building the index to the target size;
- remove: µs per block removed, evicting the last 10% of the stores (whole subtrees, leaf
  first), then re-store: the same blocks stored again;
- match: µs per request scored, ``match`` of a 64-block prompt (a conversation's next prompt)
  against all workers;
- memory (tracemalloc, a second build): bytes per (block, worker) entry, per distinct key, total.

    .venv/bin/python benchmarks/prefix_index.py                     # 10^5 blocks, 8 and 64 workers
    .venv/bin/python benchmarks/prefix_index.py --blocks 100000 1000000  # and 10^6 (~30 s each)
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import sys
import time
import tracemalloc

from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.scheduler.kv_events import BlocksRemoved, BlocksStored

BATCH = 8
PROMPT_BLOCKS = 64


class _Keys:
    """Fresh chained 16-byte keys (distinct per node)."""

    def __init__(self) -> None:
        self.n = 0

    def extend(self, prev: bytes | None, count: int) -> list[bytes]:
        out = []
        for _ in range(count):
            self.n += 1
            prev = hashlib.blake2b((prev or b"") + self.n.to_bytes(8, "little"), digest_size=16).digest()
            out.append(prev)
        return out


def workload(total: int, n_workers: int, seed: int = 0):
    """Store events (worker, parent, keys) in arrival order until ``total`` (block, worker)
    entries, and the conversations (key lists) still open at the end."""
    rng = random.Random(seed)
    keys = _Keys()
    roots = [keys.extend(None, rng.randint(8, 32)) for _ in range(300)]
    weights = [1 / (i + 1) ** 0.8 for i in range(len(roots))]
    held: list[set[bytes]] = [set() for _ in range(n_workers)]
    convs: list[tuple[list[bytes], int]] = []  # (prompt keys, home worker)
    events: list[tuple[int, bytes | None, tuple[bytes, ...]]] = []
    entries = 0
    while entries < total:
        if len(convs) < 50 or rng.random() < 0.3:
            root = rng.choices(roots, weights)[0]
            prompt = root + keys.extend(root[-1], rng.randint(4, 24))
            conv = (prompt, rng.randrange(n_workers))
            if len(convs) < 2000:
                convs.append(conv)
            else:
                convs[rng.randrange(len(convs))] = conv
        else:
            i = rng.randrange(len(convs))
            prompt, home = convs[i]
            prompt = prompt + keys.extend(prompt[-1], rng.randint(4, 24))
            if len(prompt) > 160:
                root = rng.choices(roots, weights)[0]
                prompt = root + keys.extend(root[-1], rng.randint(4, 24))
            convs[i] = conv = (prompt, home)
        w = conv[1] if rng.random() < 0.75 else rng.randrange(n_workers)
        have = held[w]
        n = 0
        while n < len(prompt) and prompt[n] in have:
            n += 1
        if n < len(prompt):
            new = prompt[n:]
            have.update(new)
            entries += len(new)
            events.append((w, prompt[n - 1] if n else None, tuple(new)))
    return events, [c[0] for c in convs], keys


def _copy(key: bytes) -> bytes:
    return bytes(memoryview(key))


def _batches(per_worker_events, seqs):
    """Interleave each worker's events into numbered batches of BATCH, round robin."""
    queues = {w: list(evs) for w, evs in per_worker_events.items()}
    out = []
    pos = dict.fromkeys(queues, 0)
    while queues:
        for w in list(queues):
            chunk = queues[w][pos[w]:pos[w] + BATCH]
            pos[w] += BATCH
            if pos[w] >= len(queues[w]):
                del queues[w]
            if chunk:
                out.append((w, seqs[w], chunk))
                seqs[w] += 1
    return out


def _by_worker(events):
    out: dict[int, list] = {}
    for w, parent, keys in events:
        out.setdefault(w, []).append((parent, keys))
    return out


def _stored(chunk):
    return [BlocksStored(None if p is None else _copy(p), tuple(_copy(k) for k in ks)) for p, ks in chunk]


def _apply_all(index, batches) -> float:
    t0 = time.perf_counter()
    for w, seq, events in batches:
        if not index.apply(f"w{w}", seq, events):
            raise AssertionError("gap in a well-formed stream")
    return time.perf_counter() - t0


def run(total: int, n_workers: int, seed: int = 0) -> dict:
    t_start = time.perf_counter()
    events, convs, keys = workload(total, n_workers, seed)
    per_worker = _by_worker(events)
    blocks = sum(len(k) for _, _, k in events)

    # Build (timed): every event with its own key copies, made beforehand.
    seqs = dict.fromkeys(range(n_workers), 0)
    build = [(w, s, _stored(chunk)) for w, s, chunk in _batches(per_worker, seqs)]
    index = PrefixIndex()
    for w in range(n_workers):
        index.add_worker(f"w{w}")
    t_store = _apply_all(index, build)
    assert index.total_entries == blocks
    del build

    # Evict the last 10% of each worker's stores, in reverse (whole subtrees, leaf first),
    # then store them again.
    tail = {w: evs[len(evs) - len(evs) // 10:] for w, evs in per_worker.items()}
    removed_blocks = sum(len(ks) for evs in tail.values() for _, ks in evs)
    removes = _batches({w: [(None, tuple(reversed(ks))) for _, ks in reversed(evs)]
                        for w, evs in tail.items()}, seqs)
    removes = [(w, s, [BlocksRemoved(tuple(_copy(k) for k in ks)) for _, ks in chunk])
               for w, s, chunk in removes]
    t_remove = _apply_all(index, removes)
    assert index.total_entries == blocks - removed_blocks
    restores = [(w, s, _stored(chunk)) for w, s, chunk in _batches(tail, seqs)]
    t_restore = _apply_all(index, restores)
    assert index.total_entries == blocks
    del removes, restores

    # Score requests: each open conversation's next prompt, cut or extended to 64 blocks.
    rng = random.Random(seed + 1)
    prompts = []
    for prompt in convs:
        p = prompt[:PROMPT_BLOCKS]
        p = p + keys.extend(p[-1], PROMPT_BLOCKS - len(p))
        prompts.append([_copy(k) for k in p])
    rng.shuffle(prompts)
    matched = [index.match(p) for p in prompts]
    reps, t_match = 0, 0.0
    while t_match < 0.3:
        t0 = time.perf_counter()
        for p in prompts:
            index.match(p)
        t_match += time.perf_counter() - t0
        reps += 1
    n_keys = index.num_keys
    del index
    gc.collect()

    # Memory: a second build under tracemalloc, copies made per batch and dropped after it, so
    # what stays traced is the index and the one key object per distinct key it keeps.
    seqs = dict.fromkeys(range(n_workers), 0)
    plan = _batches(per_worker, seqs)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex()
    for w in range(n_workers):
        index.add_worker(f"w{w}")
    for w, s, chunk in plan:
        index.apply(f"w{w}", s, _stored(chunk))
    gc.collect()
    mem = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert index.total_entries == blocks and index.num_keys == n_keys

    hits = [m for m in matched if m]
    return {
        "blocks": blocks, "workers": n_workers, "distinct_keys": n_keys,
        "store_events": len(events), "store_us_per_block": 1e6 * t_store / blocks,
        "store_us_per_event": 1e6 * t_store / len(events),
        "remove_us_per_block": 1e6 * t_remove / removed_blocks,
        "restore_us_per_block": 1e6 * t_restore / removed_blocks,
        "match_us_per_request": 1e6 * t_match / (reps * len(prompts)),
        "match_workers_hit": sum(len(m) for m in matched) / len(matched),
        "match_best_run": sum(max(m.values()) for m in hits) / max(1, len(hits)),
        "mem_bytes": mem, "bytes_per_entry": mem / blocks, "bytes_per_key": mem / n_keys,
        "seconds": time.perf_counter() - t_start,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/prefix_index.py", description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[100_000],
                        help="cached (block, worker) entries in all (default 100000)")
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)

    rows = []
    head = (f"{'blocks':>9} {'workers':>7} {'keys':>8} {'store':>7} {'remove':>7} {'restore':>7} "
            f"{'match':>7} {'hit':>5} {'run':>5} {'B/entry':>8} {'B/key':>6} {'MiB':>6} {'s':>5}")
    print("µs per block stored/removed; µs per 64-block request scored; hit: workers in a match "
          "result; run: best cached run (blocks)")
    print(head)
    for total in args.blocks:
        for n_workers in args.workers:
            r = run(total, n_workers, args.seed)
            rows.append(r)
            print(f"{r['blocks']:>9} {r['workers']:>7} {r['distinct_keys']:>8} {r['store_us_per_block']:>7.2f} "
                  f"{r['remove_us_per_block']:>7.2f} {r['restore_us_per_block']:>7.2f} "
                  f"{r['match_us_per_request']:>7.1f} {r['match_workers_hit']:>5.1f} {r['match_best_run']:>5.1f} "
                  f"{r['bytes_per_entry']:>8.0f} {r['bytes_per_key']:>6.0f} {r['mem_bytes'] / 2**20:>6.1f} "
                  f"{r['seconds']:>5.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "prefix_index", "python": sys.version.split()[0], "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
