"""How fast does `shardlm prepare` tokenise, next to HF `datasets`, and what does it save before the first step?

    python benchmarks/prepare.py [--mb 20] [--ttfs-mb 50] [--rounds 3] [--ttfs-rounds 2] [--quick] [--save]

CPU only; no process group in this script (part 2 launches torchrun). Everything is written to a temp dir
under /tmp, deleted at the end. The corpus is the running Python's stdlib sources (`builtin_files`), cut at
line ends into documents of ~--doc-kb KB, one {"text": ...} record a line, written in turn to --files .jsonl
files of equal share (cycled through the stdlib again where it is shorter than asked). The files are written
just before they are read: every reader finds them in the page cache.

1. Offline tokenisation of a --mb MB corpus (MB of text, UTF-8; the .jsonl files are larger by JSON escaping).
   Each measurement runs in a fresh Python process of its own (`--child`, imports done before the clock
   starts, torch never imported); what is timed is, end to end:
     shardlm   `resolve_sources` + `load_tokenizer` + `prepare(PrepareSpec(..., chunk_bytes=--chunk-mb),
               workers=N)`: planning the units, the worker pool (spawned processes that import
               shardlm.data.store.prepare and the tokenizer), reading + JSON decoding + encoding + writing the parts,
               then the serial assembly (concatenate, sha256, fsync, manifest). workers=1 runs in the
               process itself, no pool (as shardlm does). Its progress bar is off (stderr is a pipe).
     datasets  `Tokenizer.from_file` + `Dataset.from_json(files, cache_dir=fresh, num_proc=N)` (JSON -> an
               Arrow cache file) + `.map(tokenize, batched=True, num_proc=N, remove_columns=["text"])`
               (encode_batch of the same tokenizer.json, add_special_tokens=False; writes its Arrow cache
               files), defaults otherwise (batch_size 1000, progress bars on into a pipe, caching on in the
               fresh dir). num_proc=1 is passed as None: no pool, as a user would run it.
   Tokenizers: (a) shardlm's byte tokenizer (shardlm only); (b) a ByteLevel BPE of --vocab ids trained here
   with `tokenizers` on the first --tok-train-mb MB of the corpus (no download), saved as tokenizer.json.
   TOKENIZERS_PARALLELISM is left as found: a tokenizer used in one process encodes a batch on every core
   (shardlm's 1 worker, datasets' num_proc=1: "CPU s" shows it); shardlm's pool workers set it to false
   (one process per core already); datasets' forked workers keep it on (4 threads on 2 cores at num_proc=2).
   HF_DATASETS_OFFLINE/HF_HUB_OFFLINE=1 and HF_HOME in the temp dir for the datasets runs (no network).
   --rounds rounds, the order of the cases rotated by one each round (load from other jobs hits all alike);
   medians of the wall times, and ratios as the median of the per-round ratios. CPU s = user + system
   seconds of the process and its workers. tokens = ids written + one EOS per document (the store's count).
   Checks: every store of one tokenizer (1 and 2 workers, every round) has the same bytes, every file of it
   (exit status 1 if not); datasets' ids with an EOS after each document == shardlm's BPE tokens.bin.

2. Time to the first step of a 2-rank run: `torchrun --standalone --nproc_per_node 2 -m shardlm train
   --data.path=... --train.steps=1 --data.tokenizer=bytes --model.preset=debug ...` on a --ttfs-mb MB corpus
   (byte tokenizer: a byte is a token), (i) from a store made beforehand with `shardlm prepare CORPUS STORE
   --workers 2 --data.tokenizer=bytes` (its wall time, interpreter start included, is printed too) and
   (ii) from the raw .jsonl files with a fresh data.cache_dir: the run prepares the store itself before the
   process group starts (data.prepare_workers=0: every core; 64 MB units, one per file here). Timed from
   launch to the line starting `step      1` on the run's stdout (read line by line; PYTHONUNBUFFERED=1);
   the preparation inside (ii) is its own `prepare: wrote ... in X.Ys` line. --ttfs-rounds rounds, the order
   alternating; ratio raw/store per round, median.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The measured child processes (`--child`) import only what they measure: _common (which imports torch) is
# imported by the parent, in main().

RESULT = Path(__file__).resolve().parent / "results" / "prepare_cpu.txt"
EOS = "<|endoftext|>"
MB = 10**6
STEP1 = f"step {1:>6}"  # the first step's log line: "step      1 | loss ..."


# -- the corpus ------------------------------------------------------------------------------------

def stdlib_documents(doc_bytes: int, passes: list[int]):
    """The stdlib's .py sources (UTF-8 ones) cut at line ends into documents of ~doc_bytes, forever (cycled;
    passes[0] counts the passes begun)."""
    from shardlm.data.sources import builtin_files

    files = builtin_files()
    while True:
        passes[0] += 1
        for f in files:
            try:
                text = f.read_text("utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            doc, size = [], 0
            for line in text.splitlines(keepends=True):
                doc.append(line)
                size += len(line.encode())
                if size >= doc_bytes:
                    yield "".join(doc)
                    doc, size = [], 0
            if doc and "".join(doc).strip():
                yield "".join(doc)


def write_jsonl_corpus(folder: Path, text_bytes: int, n_files: int, doc_bytes: int) -> dict:
    """~text_bytes of documents into n_files .jsonl files of equal share; returns what was written."""
    folder.mkdir(parents=True)
    passes = [0]
    docs = stdlib_documents(doc_bytes, passes)
    share, total, n_docs = text_bytes / n_files, 0, 0
    for i in range(n_files):
        with open(folder / f"part-{i:02d}.jsonl", "w") as out:
            while total < share * (i + 1):
                text = next(docs)
                out.write(json.dumps({"text": text}) + "\n")
                total += len(text.encode())
                n_docs += 1
    file_bytes = sum(p.stat().st_size for p in folder.iterdir())
    return {"text_bytes": total, "file_bytes": file_bytes, "documents": n_docs, "files": n_files,
            "passes": passes[0]}


# -- the measured children -------------------------------------------------------------------------

def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its reaped children (pool workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def child_train_tokenizer(job: dict) -> dict:
    """A ByteLevel BPE of job["vocab"] ids trained on the corpus's first job["train_bytes"] of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        seen = 0
        for f in sorted(Path(job["corpus"]).glob("*.jsonl")):
            with open(f) as fh:
                for line in fh:
                    text = json.loads(line)["text"]
                    yield text
                    seen += len(text.encode())
                    if seen >= job["train_bytes"]:
                        return

    t0 = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=job["vocab"], special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    Path(job["out"]).mkdir(parents=True)
    tok.save(str(Path(job["out"]) / "tokenizer.json"))
    return {"wall": time.perf_counter() - t0, "vocab": tok.get_vocab_size(with_added_tokens=True)}


def child_shardlm(job: dict) -> dict:
    """Time one `prepare` (see the module docstring); the serial assembly's share is timed by wrapping it."""
    import shardlm.data.store.prepare as store_mod
    from shardlm.data.sources import plan_units, resolve_sources
    from shardlm.data.store.prepare import PrepareSpec, prepare
    from shardlm.data.tokenizer import load_tokenizer

    assembly = [0.0]
    assemble = store_mod._assemble

    def timed_assemble(*a, **k):
        t = time.perf_counter()
        try:
            return assemble(*a, **k)
        finally:
            assembly[0] += time.perf_counter() - t

    store_mod._assemble = timed_assemble
    lines: list[str] = []
    c0, t0 = cpu_seconds(), time.perf_counter()
    files = resolve_sources(job["corpus"])
    tok = load_tokenizer(job["tokenizer"])
    spec = PrepareSpec(files, job["tokenizer"], tok.fingerprint, "text", chunk_bytes=job["chunk_bytes"])
    store = prepare(spec, Path(job["out"]), workers=job["workers"], log=lines.append, progress=False)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    used = re.search(r"with (\d+) worker", lines[-1])
    return {"wall": wall, "cpu": cpu, "assembly": assembly[0], "documents": store.documents,
            "tokens": store.n_tokens, "workers_used": int(used.group(1)) if used else None,
            "units": len(plan_units(files, job["chunk_bytes"])),
            "tokens_sha256": store.manifest["sha256"]["tokens.bin"]}


def child_datasets(job: dict) -> dict:
    """Time from_json + map (see the module docstring); then hash its ids as shardlm would store them."""
    import numpy as np
    import pyarrow as pa
    from datasets import Dataset
    from tokenizers import Tokenizer

    files = [str(f) for f in sorted(Path(job["corpus"]).glob("*.jsonl"))]
    num_proc = job["num_proc"] if job["num_proc"] > 1 else None
    c0, t0 = cpu_seconds(), time.perf_counter()
    tok = Tokenizer.from_file(job["tokenizer"])

    def tokenize(batch):
        return {"input_ids": [e.ids for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}

    ds = Dataset.from_json(files, cache_dir=job["cache"], num_proc=num_proc)
    ds = ds.map(tokenize, batched=True, num_proc=num_proc, remove_columns=["text"])
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0

    col = ds.data.table.column("input_ids").combine_chunks()
    if isinstance(col, pa.ChunkedArray):
        col = col.chunk(0)
    offsets = np.asarray(col.offsets)
    values = np.asarray(col.flatten()).astype(np.uint16)
    stream = np.insert(values, offsets[1:] - offsets[0], tok.token_to_id(EOS))  # EOS after each document
    return {"wall": wall, "cpu": cpu, "documents": len(ds), "tokens": int(stream.size),
            "dtype": str(ds.features["input_ids"]), "tokens_sha256": hashlib.sha256(stream.tobytes()).hexdigest()}


CHILDREN = {"train_tokenizer": child_train_tokenizer, "shardlm": child_shardlm, "datasets": child_datasets}


SPIN = "import time\nt0, c0 = time.perf_counter(), time.process_time()\nwhile time.perf_counter() - t0 < {s}: pass\n" \
       "print(time.process_time() - c0)"


def cpu_share(n: int, seconds: float = 1.0) -> float:
    """CPU-seconds per wall-second that n busy processes get together: what this machine's other jobs leave."""
    ps = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=seconds)], stdout=subprocess.PIPE, text=True)
          for _ in range(n)]
    return sum(float(p.communicate()[0]) for p in ps) / seconds


def run_child(job: dict, env: dict | None = None) -> dict:
    """Run one measurement in a fresh Python process; its last stdout line is the result (JSON)."""
    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True, text=True,
                       env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{job['kind']} child failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# -- part 2: time to first step --------------------------------------------------------------------

def time_to_first_step(cmd: list[str], env: dict) -> dict:
    """Launch cmd, read its stdout line by line: seconds to the first step's line, the prepare line's own time."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
    out: dict = {"prepare": None, "prepare_line_at": None, "step1": None}
    tail: list[str] = []
    assert p.stdout is not None
    for line in p.stdout:
        now = time.perf_counter() - t0
        tail = (tail + [line.rstrip()])[-40:]
        if m := re.match(r"prepare: wrote .* in ([\d.]+)s", line):
            out["prepare"], out["prepare_line_at"] = float(m.group(1)), now
        if line.startswith(STEP1) and out["step1"] is None:
            out["step1"] = now
    rc = p.wait()
    if rc != 0 or out["step1"] is None:
        raise RuntimeError(f"training run failed (exit {rc}, first step seen: {out['step1'] is not None}):\n"
                           + "\n".join(tail))
    return out


def train_cmd(data_path: Path, output_dir: Path, cache_dir: Path) -> list[str]:
    bin_dir = Path(sys.executable).parent
    return [str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "shardlm", "train",
            f"--data.path={data_path}", "--train.steps=1", "--data.tokenizer=bytes", "--model.preset=debug",
            f"--train.output_dir={output_dir}", f"--data.cache_dir={cache_dir}", "--metrics.progress_bar=false",
            "--checkpoint.save_final=false", "--train.sample_tokens=0"]


def shardlm_cli() -> list[str]:
    exe = Path(sys.executable).parent / "shardlm"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "shardlm"]


# -- the parent ------------------------------------------------------------------------------------

def store_digest(path: Path) -> dict[str, str]:
    """sha256 of every file of a store, by relative path."""
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


def versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{n} {version(n)}" for n in ("torch", "tokenizers", "datasets", "pyarrow", "numpy"))


CASES = [("shardlm", "bytes", 1), ("shardlm", "bytes", 2), ("shardlm", "bpe", 1), ("shardlm", "bpe", 2),
         ("datasets", "bpe", 1), ("datasets", "bpe", 2)]
SL = ("shardlm", "bpe", 1)  # the case whose first run the others' figures are read against


def part1(args, tmp: Path, du, say) -> tuple[list[str], bool]:
    """Offline tokenisation: the corpus, the BPE, the rounds; -> (report lines, whether every check held)."""
    corpus = tmp / "corpus"
    info = write_jsonl_corpus(corpus, int(args.mb * MB), args.files, args.doc_kb * 1000)
    say(f"corpus: {info['text_bytes'] / MB:.1f} MB of text, {info['documents']:,} documents, "
        f"{info['files']} files, {info['file_bytes'] / MB:.1f} MB as .jsonl")
    tok = run_child({"kind": "train_tokenizer", "corpus": str(corpus), "vocab": args.vocab,
                     "train_bytes": int(args.tok_train_mb * MB), "out": str(tmp / "tok")})
    say(f"BPE trained: {tok['vocab']:,} ids in {tok['wall']:.1f}s")
    share0 = (cpu_share(1), cpu_share(2))
    res, digests = tokenise_rounds(args, tmp, corpus, str(tmp / "tok" / "tokenizer.json"), du, say)
    share1 = (cpu_share(1), cpu_share(2))
    checks, ok = part1_checks(res, digests)
    return part1_header(args, info, tok, res, share0, share1) + part1_table(res) + checks, ok


def tokenise_rounds(args, tmp: Path, corpus: Path, tok_json: str, du, say) -> tuple[dict, dict]:
    """Every case once a round, the order rotated by one each round. -> (per case: each run's figures, per
    tokenizer: (case, the store's file digests) of each shardlm run)."""
    ds_env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf_home")}
    res: dict[tuple, list[dict]] = {c: [] for c in CASES}
    digests: dict[str, list[tuple[tuple, dict]]] = {"bytes": [], "bpe": []}
    run_id = 0
    for r in range(args.rounds):
        for c in CASES[r % len(CASES):] + CASES[:r % len(CASES)]:
            lib, tk, n = c
            run_id += 1
            out = tmp / f"run{run_id}"
            if lib == "shardlm":
                got = run_child({"kind": "shardlm", "corpus": str(corpus), "out": str(out / "store"),
                                 "tokenizer": "bytes" if tk == "bytes" else tok_json, "workers": n,
                                 "chunk_bytes": args.chunk_mb << 20})
                got["disk"] = du(out / "store")
                digests[tk].append((c, store_digest(out / "store")))
            else:
                got = run_child({"kind": "datasets", "corpus": str(corpus), "cache": str(out / "cache"),
                                 "tokenizer": tok_json, "num_proc": n}, env=ds_env)
                got["disk"] = du(out / "cache")
            shutil.rmtree(out, ignore_errors=True)
            res[c].append(got)
            say(f"[round {r + 1}/{args.rounds}] {name(c):<30} {got['wall']:6.2f} s wall, {got['cpu']:6.2f} CPU s, "
                f"{got['tokens'] / got['wall']:>12,.0f} tokens/s")
    return res, digests


def part1_header(args, info: dict, tok: dict, res: dict, share0: tuple, share1: tuple) -> list[str]:
    """What was tokenised, with which BPE, how many tokens, how much CPU the other jobs left."""
    first = {c: res[c][0] for c in CASES}
    return [
        f"1. offline tokenisation: {info['text_bytes'] / MB:.1f} MB of text (stdlib .py cut into {info['documents']:,} "
        f"documents of ~{args.doc_kb} KB) in {info['files']} .jsonl files ({info['file_bytes'] / MB:.1f} MB), "
        f"--chunk-mb {args.chunk_mb} -> {first[SL]['units']} units{cycled(info)}",
        f"   BPE: ByteLevel, {tok['vocab']:,} ids, trained with `tokenizers` on the first {args.tok_train_mb:g} MB "
        f"({tok['wall']:.1f} s, untimed); {args.rounds} round(s), case order rotated per round, median wall times",
        f"   tokens (ids + an EOS per document): bytes {first[('shardlm', 'bytes', 1)]['tokens']:,}, BPE "
        f"{first[SL]['tokens']:,} ({info['text_bytes'] / (first[SL]['tokens'] - first[SL]['documents']):.2f} "
        f"text bytes/id); datasets stores input_ids as {first[('datasets', 'bpe', 1)]['dtype']}",
        f"   CPU the other jobs left: 1 / 2 busy processes got {share0[0]:.2f} / {share0[1]:.2f} CPU-s per wall-s "
        f"before the rounds, {share1[0]:.2f} / {share1[1]:.2f} after (2.0 = both cores free)",
        "",
    ]


def part1_table(res: dict) -> list[str]:
    """One row per case (medians, every round's wall time), then the speed ratios."""
    def ratio(a: tuple, b: tuple) -> float:  # b's speed over a's: the median of the per-round wall(a) / wall(b)
        return statistics.median(ga["wall"] / gb["wall"] for ga, gb in zip(res[a], res[b]))

    lines = [f"   {'case':<30} {'wall s':>7} {'CPU s':>6} {'CPU/wall':>8} {'tokens/s':>11} {'tokens/CPU-s':>12} "
             f"{'docs/s':>7} {'out MB':>7} {'assembly s':>10}  walls by round"]
    for c in CASES:
        g, w = res[c], statistics.median(x["wall"] for x in res[c])
        cpu = statistics.median(x["cpu"] for x in g)
        asm = f"{statistics.median(x['assembly'] for x in g):>10.2f}" if c[0] == "shardlm" else f"{'-':>10}"
        lines.append(f"   {name(c):<30} {w:>7.2f} {cpu:>6.1f} {cpu / w:>8.2f} {g[0]['tokens'] / w:>11,.0f} "
                     f"{g[0]['tokens'] / cpu:>12,.0f} {g[0]['documents'] / w:>7,.0f} {g[0]['disk'] / MB:>7.1f} "
                     f"{asm}  " + " ".join(f"{x['wall']:.2f}" for x in g))
    lines.append("   (assembly: shardlm's serial concatenation of the parts + sha256 + fsync + manifest, inside the "
                 "wall time; out MB: the store, or datasets' cache dir: text Arrow file + input_ids Arrow files)")
    sb1, sb2, sp1, sp2 = (("shardlm", "bytes", 1), ("shardlm", "bytes", 2), SL, ("shardlm", "bpe", 2))
    dp1, dp2 = ("datasets", "bpe", 1), ("datasets", "bpe", 2)
    return lines + [
        "",
        "   speed ratios (median of per-round ratios, >1 = faster):",
        f"     shardlm bytes  2 workers / 1 worker            {ratio(sb1, sb2):.2f}x",
        f"     shardlm BPE    2 workers / 1 worker            {ratio(sp1, sp2):.2f}x",
        f"     datasets BPE   num_proc=2 / num_proc=1         {ratio(dp1, dp2):.2f}x",
        f"     shardlm 2 workers / datasets num_proc=2 (BPE)  {ratio(dp2, sp2):.2f}x",
        f"     shardlm 1 worker  / datasets num_proc=1 (BPE)  {ratio(dp1, sp1):.2f}x",
    ]


def part1_checks(res: dict, digests: dict) -> tuple[list[str], bool]:
    """Stores byte-identical whatever the workers; datasets' ids == shardlm's; the workers prepare used."""
    ok, parts = True, []
    for tk, runs in digests.items():
        same = all(d == runs[0][1] for _, d in runs)
        ok &= same
        parts.append(f"{tk} {'yes' if same else 'NO'} ({len(runs)} stores: "
                     f"{', '.join(sorted({f'{c[2]} worker(s)' for c, _ in runs}))})")
    lines = [f"   stores byte-identical whatever the workers (every file): {'; '.join(parts)}"]
    same_ids = all(g["tokens_sha256"] == res[SL][0]["tokens_sha256"] for c in CASES if c[1] == "bpe" for g in res[c])
    lines.append(f"   datasets' ids (+ EOS per document, as uint16) == shardlm's BPE tokens.bin: "
                 f"{'yes' if same_ids else 'NO'}")
    used = {c: res[c][0].get("workers_used") for c in CASES if c[0] == "shardlm"}
    if any(n != c[2] for c, n in used.items()):
        lines.append(f"   note: workers used by prepare: {', '.join(f'{name(c)}: {n}' for c, n in used.items())}")
    return lines, ok and same_ids


def cycled(info: dict) -> str:
    return f" (the stdlib read {info['passes']} times over: it is shorter)" if info["passes"] > 1 else ""


def name(c: tuple) -> str:
    lib, tk, n = c
    if lib == "shardlm":
        return f"shardlm {'bytes' if tk == 'bytes' else 'BPE'}, {n} worker{'s' if n > 1 else ''}"
    return f"datasets BPE, num_proc={n}"


def part2(args, tmp: Path, say) -> list[str]:
    corpus = tmp / "ttfs_corpus"
    info = write_jsonl_corpus(corpus, int(args.ttfs_mb * MB), args.files, args.doc_kb * 1000)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    store = tmp / "ttfs_store"
    t0 = time.perf_counter()
    p = subprocess.run([*shardlm_cli(), "prepare", str(corpus), str(store), "--workers", "2",
                        "--data.tokenizer=bytes"], capture_output=True, text=True)
    cli_wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"shardlm prepare failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    cli_line = next((ln for ln in p.stdout.splitlines() if ln.startswith("prepare: wrote")), "?")
    say(f"offline: {cli_line} ({cli_wall:.1f}s wall with interpreter start)")
    store_sha = json.loads((store / "manifest.json").read_text())["sha256"]["tokens.bin"]

    rows, same = [], True
    for r in range(args.ttfs_rounds):
        got = {}
        for which in (("store", "raw") if r % 2 == 0 else ("raw", "store")):
            run = tmp / f"ttfs_{which}_{r}"
            cache = run / "cache"
            got[which] = time_to_first_step(train_cmd(store if which == "store" else corpus, run / "out", cache), env)
            if which == "raw":
                made = [m for m in cache.glob("*/manifest.json")]
                same &= bool(made) and json.loads(made[0].read_text())["sha256"]["tokens.bin"] == store_sha
            shutil.rmtree(run, ignore_errors=True)
            say(f"[round {r + 1}/{args.ttfs_rounds}] from {which:<5}: first step at {got[which]['step1']:.1f}s"
                + (f" (prepare inside: {got[which]['prepare']:.1f}s)" if which == "raw" else ""))
        rows.append((got["store"]["step1"], got["raw"]["step1"], got["raw"]["prepare"],
                     got["raw"]["prepare_line_at"]))
    lines = [
        f"2. time to first step, 2 ranks (torchrun --standalone, gloo, CPU), debug preset, 1 step, byte tokenizer: "
        f"{info['text_bytes'] / MB:.1f} MB of text = {info['text_bytes'] + info['documents']:,} tokens, "
        f"{info['documents']:,} documents in {info['files']} .jsonl files ({info['file_bytes'] / MB:.1f} MB)"
        + cycled(info),
        f"   made beforehand: `shardlm prepare CORPUS STORE --workers 2 --data.tokenizer=bytes`: "
        f"{cli_wall:.1f} s wall (interpreter start included); its line: {cli_line}",
        "",
        f"   {'round':>6} {'from store s':>13} {'from raw files s':>17} {'prepare inside s':>17} "
        f"{'its line at s':>14} {'raw/store':>10}",
    ]
    for i, (s, rw, prep, at) in enumerate(rows, 1):
        lines.append(f"   {i:>6} {s:>13.1f} {rw:>17.1f} {prep:>17.1f} {at:>14.1f} {rw / s:>10.2f}")
    med = [statistics.median(x[k] for x in rows) for k in range(4)]
    lines.append(f"   {'median':>6} {med[0]:>13.1f} {med[1]:>17.1f} {med[2]:>17.1f} {med[3]:>14.1f} "
                 f"{statistics.median(x[1] / x[0] for x in rows):>10.2f}")
    lines.append(f"   (seconds from launch to the `{STEP1}` line; \"its line at\": when the raw run printed "
                 f"`prepare: wrote`; the raw run's cached store == the CLI's store: {'yes' if same else 'NO'})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=20, help="part 1 corpus, MB of text (default 20)")
    ap.add_argument("--files", type=int, default=4, help=".jsonl files per corpus (default 4)")
    ap.add_argument("--doc-kb", type=int, default=4, help="document size, KB (default 4)")
    ap.add_argument("--chunk-mb", type=int, default=2,
                    help="part 1: shardlm's unit size (PrepareSpec.chunk_bytes, MiB; default 2)")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary (default 8192)")
    ap.add_argument("--tok-train-mb", type=float, default=2, help="BPE training text, MB (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="part 1 rounds (default 3)")
    ap.add_argument("--ttfs-mb", type=float, default=50, help="part 2 corpus, MB of text = tokens (default 50)")
    ap.add_argument("--ttfs-rounds", type=int, default=2, help="part 2 rounds (default 2)")
    ap.add_argument("--quick", action="store_true", help="small sizes, one round each: a smoke test")
    ap.add_argument("--save", action="store_true", help=f"also write the report to benchmarks/results/{RESULT.name}")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        job = json.loads(args.child)
        print(json.dumps(CHILDREN[job["kind"]](job)), flush=True)
        return
    if args.quick:
        if args.save:
            ap.error("--quick figures are a smoke test: not saved")
        args.mb, args.ttfs_mb, args.tok_train_mb, args.rounds, args.ttfs_rounds = 2, 4, 0.5, 1, 1
    if min(args.rounds, args.ttfs_rounds, args.files, args.doc_kb, args.chunk_mb) < 1:
        ap.error("--rounds, --ttfs-rounds, --files, --doc-kb and --chunk-mb must be >= 1")

    from _common import du, report

    def say(msg: str) -> None:
        print(msg, flush=True)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load0 = os.getloadavg()[0]
    head = [f"shardlm prepare benchmark | {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
            f"({cores} usable, shared with other jobs) | python {platform.python_version()}, {versions()}",
            f"settings: --mb {args.mb:g} --files {args.files} --doc-kb {args.doc_kb} --chunk-mb {args.chunk_mb} "
            f"--vocab {args.vocab} --tok-train-mb {args.tok_train_mb:g} --rounds {args.rounds} "
            f"--ttfs-mb {args.ttfs_mb:g} --ttfs-rounds {args.ttfs_rounds}{' (--quick)' if args.quick else ''}; "
            f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}"]
    say(head[0])
    tmp = Path(tempfile.mkdtemp(prefix="shardlm-prepare-bench-", dir="/tmp"))
    try:
        lines1, ok = part1(args, tmp, du, say)
        lines2 = part2(args, tmp, say)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    head.append(f"load average (1 min): {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    report(head + [""] + lines1 + [""] + lines2, RESULT if args.save else None)
    if not ok:
        print("FAILED: stores differ with the number of workers, or datasets' ids differ from shardlm's",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
