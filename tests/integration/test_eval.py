"""`shardlm eval` as a user runs it, on local lm-eval tasks, against lm-eval's own HF backend (`HFLM`).

Three task YAMLs over jsonl files this module writes (no hub, no network): multiple choice with two few-shot
examples (loglikelihood; with `--max-length 48` its longer requests are truncated from the left), wikitext-style
perplexity (loglikelihood_rolling; documents of several 48-token windows) and short answers (generate_until,
cut at "\\n" or "e", which the random model's text has). The model is `make_tiny_hf`'s llama, its tokenizer made
to add a BOS (`<|system|>`, not EOS) as Llama 3's does, so the BOS and prefix-token paths run. `shardlm eval
--hf` and `--checkpoint` (its `convert hf-to-dcp` import) must give, request by request, HFLM's log-likelihoods
(fp32, within 1e-4), greedy flags and generations on the HF folder, and its metrics. Rolling log-likelihoods are
compared with HFLM(add_bos_token=False): HFLM otherwise scores a second BOS after its prefix BOS (lm-eval issue
#3333), where shardlm conditions the text on one prefix token. Everything runs in this process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shardlm.cli import main

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 48
LIMIT = 6
TOL = 1e-4
BOS = "<|system|>"

MC = [("Which module joins paths?", ["os.path", "json", "re", "math"], 0),
      ("Which function returns a length?", ["len", "sum", "print"], 0),
      ("What does import do?", ["loads a module", "prints text", "sorts a list"], 0),
      ("Which keyword defines a function?", ["def", "class", "lambda", "return"], 0),
      ("Which type is immutable?", ["tuple", "list", "dict"], 0),
      ("Which loop repeats while a condition holds?", ["while", "for", "if"], 0),
      ("Which exception means a missing key?", ["KeyError", "ValueError", "TypeError"], 0),
      ("Which builtin opens a file?", ["open", "read", "file"], 0)]
TEXTS = [
    "The os module provides a portable way of using operating system dependent functionality. " * 3,
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 2,
    "Return the number of items in a container.",
    "import sys\nprint(sys.argv)\n" * 5,
    "Lists are mutable sequences, typically used to store collections of homogeneous items.",
    "x",
]
QA = [("Complete: import os.pa", "th"), ("def f(x): return x +", " 1"), ("The answer is", " 42"),
      ("for i in range(", "10)"), ("print(", "'hi')"), ("x = [1, 2,", " 3]")]


TASKS = {  # the YAML of each task after its name and data files (raw strings: the \n are YAML's)
    "tiny_mc": r"""
        output_type: multiple_choice
        training_split: train
        fewshot_split: train
        num_fewshot: 2
        doc_to_text: "Question: {{question}}\nAnswer:"
        doc_to_choice: "{{choices}}"
        doc_to_target: answer
        metric_list:
          - {metric: acc, aggregation: mean, higher_is_better: true}
          - {metric: acc_norm, aggregation: mean, higher_is_better: true}
        """,
    "tiny_ppl": r"""
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list:
          - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
          - {metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
          - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}
        """,
    "tiny_gen": r"""
        output_type: generate_until
        doc_to_text: "{{prompt}}"
        doc_to_target: "{{answer}}"
        generation_kwargs: {until: ["\n", "e"], do_sample: false, max_gen_toks: 10}
        metric_list:
          - {metric: exact_match, aggregation: mean, higher_is_better: true}
        """,
}


def _write_tasks(folder: Path) -> None:
    """tiny_mc, tiny_ppl and tiny_gen: task YAMLs over jsonl files, in `folder` (lm-eval's --include-path)."""
    folder.mkdir()

    def jsonl(name: str, rows: list[dict]) -> str:
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(folder / name)

    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in MC]
    files = {"tiny_mc": {"train": jsonl("mc_train.jsonl", mc[6:]), "test": jsonl("mc_test.jsonl", mc[:6])},
             "tiny_ppl": {"test": jsonl("ppl.jsonl", [{"text": t} for t in TEXTS])},
             "tiny_gen": {"test": jsonl("gen.jsonl", [{"prompt": p, "answer": a} for p, a in QA])}}
    for name, body in TASKS.items():
        head = (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files: {json.dumps(files[name])}\n"
                "test_split: test\n")
        (folder / f"{name}.yaml").write_text(head + textwrap.dedent(body).lstrip())


def _add_bos(hf: Path) -> None:
    """Make the folder's tokenizer prepend BOS (a TemplateProcessing post-processor, as Llama 3's)."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos)])
    tok.save(str(hf / "tokenizer.json"))
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": BOS}))


@pytest.fixture(scope="module")
def lm_eval_here():
    """Offline, and without lm-eval's environment report (torch's collect_env: ~11 processes, pip list among
    them, per evaluation)."""
    import lm_eval.evaluator

    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(var, "1")
        mp.setattr(lm_eval.evaluator, "add_env_info", lambda results: None, raising=False)
        yield


@pytest.fixture(scope="module")
def assets(tmp_path_factory, lm_eval_here):
    from shardlm.assets.debug_hf import make_tiny_hf
    from shardlm.interop.hf.import_ import import_hf_to_dcp

    tmp = tmp_path_factory.mktemp("eval")
    hf = make_tiny_hf(tmp / "hf", arch="llama")
    _add_bos(hf)
    import_hf_to_dcp(hf, tmp / "ck")
    _write_tasks(tmp / "tasks")
    return {"hf": hf, "ck": tmp / "ck", "tasks": tmp / "tasks", "tmp": tmp}


def _eval_args(assets, out: Path) -> list[str]:
    return ["--tasks", "tiny_mc,tiny_ppl,tiny_gen", "--include-path", str(assets["tasks"]), "--limit", str(LIMIT),
            "--batch-size", "4", "--max-length", str(WINDOW), "--bootstrap-iters", "0", "--log-samples",
            "--output", str(out)]


def _shardlm_eval(assets, source: list[str], out: Path) -> dict:
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        rc = main(["eval", *source, *_eval_args(assets, out)])
    assert rc == 0  # the error line is in the captured stderr
    assert "|tiny_mc" in stdout.getvalue() and "word_perplexity" in stdout.getvalue()  # the results table
    return json.loads(out.read_text())


def _hflm(hf: Path, tasks: list[str], task_dir: Path, **kwargs) -> dict:
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(hf), dtype="float32", device="cpu", batch_size=4, max_length=WINDOW, **kwargs)
    return evaluator.simple_evaluate(model=lm, tasks=tasks, limit=LIMIT, bootstrap_iters=0, log_samples=True,
                                     task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))


def _responses(results: dict, task: str) -> list:
    """Each document's requests (their arguments) and raw responses, in document order."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return json.loads(json.dumps([(s["arguments"], s["resps"]) for s in samples]))  # tuples as lists


def _assert_loglikelihoods_close(got: list, want: list) -> None:
    assert len(got) == len(want) == LIMIT
    for (args_got, resp_got), (args_want, resp_want) in zip(got, want):
        assert args_got == args_want  # the same prompts, few-shot examples included
        flat_got = [r for rs in resp_got for r in rs]
        flat_want = [r for rs in resp_want for r in rs]
        assert len(flat_got) == len(flat_want)
        for g, w in zip(flat_got, flat_want):
            if isinstance(w, (list, tuple)):  # loglikelihood: (log p, is greedy)
                assert abs(float(g[0]) - float(w[0])) <= TOL, (g, w)
                assert str(g[1]) == str(w[1]), (g, w)
            else:  # loglikelihood_rolling: log p
                assert abs(float(g) - float(w)) <= TOL, (g, w)


@pytest.fixture(scope="module")
def hf_run(assets):
    """`shardlm eval --hf` on the three tasks (the reference of the checkpoint and torchrun runs)."""
    return _shardlm_eval(assets, ["--hf", str(assets["hf"])], assets["tmp"] / "hf.json")


def test_eval_equals_lm_eval_hf_backend_from_hf_folder_and_checkpoint(assets, hf_run):
    ours = hf_run
    hf = _hflm(assets["hf"], ["tiny_mc", "tiny_gen"], assets["tasks"])
    hf_rolling = _hflm(assets["hf"], ["tiny_ppl"], assets["tasks"], add_bos_token=False)

    mc = _responses(ours, "tiny_mc")
    assert mc[0][0][0][0].startswith("Question: ") and "\n\n" in mc[0][0][0][0]  # two few-shot examples
    _assert_loglikelihoods_close(mc, _responses(hf, "tiny_mc"))
    _assert_loglikelihoods_close(_responses(ours, "tiny_ppl"), _responses(hf_rolling, "tiny_ppl"))
    gen = _responses(ours, "tiny_gen")
    assert gen == _responses(hf, "tiny_gen")  # greedy text, cut at the first "\n" / "e"
    assert any(r[0][0] for _, r in gen) and all("e" not in r[0][0] for _, r in gen)
    for task, metric in (("tiny_mc", "acc,none"), ("tiny_mc", "acc_norm,none"), ("tiny_gen", "exact_match,none")):
        assert ours["results"][task][metric] == hf["results"][task][metric]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["tiny_ppl"][metric] == pytest.approx(hf_rolling["results"]["tiny_ppl"][metric],
                                                                    rel=1e-5)

    ck = _shardlm_eval(assets, ["--checkpoint", str(assets["ck"])], assets["tmp"] / "ck.json")
    _assert_same_run(ck, ours)
    assert ck["config"]["model_source"].startswith("checkpoint:")


def _assert_same_run(got: dict, want: dict) -> None:
    for task in ("tiny_mc", "tiny_ppl"):
        _assert_loglikelihoods_close(_responses(got, task), _responses(want, task))
    assert _responses(got, "tiny_gen") == _responses(want, "tiny_gen")


@pytest.mark.slow
def test_eval_under_torchrun_shards_the_model_and_gives_the_same_scores(assets, hf_run, tmp_path):
    # 2 gloo ranks, the checkpoint sharded: every rank runs every request (the forwards in lockstep); rank 0
    # prints and writes. One spawn.
    out = tmp_path / "torchrun.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                        "shardlm", "eval", "--checkpoint", str(assets["ck"]), *_eval_args(assets, out)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "on 2 ranks (FSDP)" in p.stderr and p.stdout.count("|tiny_mc") == 1  # one table: rank 0's
    _assert_same_run(json.loads(out.read_text()), hf_run)


def test_the_adapter_encodes_as_hflm_and_rejects_what_does_not_fit(assets):
    import transformers

    from shardlm.errors import ConfigError
    from shardlm.eval.harness import ShardlmLM, parse_gen_kwargs

    lm = ShardlmLM(hf=str(assets["hf"]), max_length=WINDOW)
    hf_tok = transformers.AutoTokenizer.from_pretrained(assets["hf"])
    bos = hf_tok.convert_tokens_to_ids(BOS)
    assert lm.prefix_token_id == bos != lm.eot_token_id == hf_tok.eos_token_id and lm.max_length == WINDOW
    for text in ("import os", " x y"):
        assert lm.tok_encode(text) == hf_tok(text)["input_ids"]
    assert lm.tok_encode(f"{BOS}import os") == hf_tok(f"{BOS}import os", add_special_tokens=False)["input_ids"]
    assert lm.tok_encode("import os")[0] == bos and lm.tok_encode("import os", add_special_tokens=False)[0] != bos
    no_bos = ShardlmLM(lm.inf, add_bos_token=False)
    assert no_bos.tok_encode("import os") == hf_tok("import os", add_special_tokens=False)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert lm.apply_chat_template(chat) == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ConfigError, match="max_length"):
        ShardlmLM(lm.inf, max_length=lm.inf.context + 1)
    with pytest.raises(ConfigError, match="raise --max-length"):
        lm._loglikelihood_tokens([(None, [1], list(range(WINDOW + 1)))])
    assert parse_gen_kwargs({"until": "\n\n", "do_sample": False, "temperature": 0.7}, 256)[:2] == (["\n\n"], 256)
    until, n, sampling = parse_gen_kwargs({"until": ["a"], "max_gen_toks": 5, "do_sample": True, "top_p": 0.9}, 256)
    assert (until, n, sampling.temperature, sampling.top_p) == (["a"], 5, 1.0, 0.9)
    assert parse_gen_kwargs({"temperature": 0.7}, 256)[2].greedy  # HFLM: greedy unless do_sample


def test_eval_errors_are_one_line(assets, monkeypatch, capsys):
    hf = ["eval", "--hf", str(assets["hf"])]
    assert main([*hf, "--tasks", " , "]) == 2
    assert "--tasks names no task" in capsys.readouterr().err
    assert main([*hf, "--tasks", "tiny_mc", "--include-path", str(assets["tmp"] / "nope")]) == 2
    assert "--include-path" in capsys.readouterr().err
    assert main([*hf, "--tasks", "tiny_mc", "--log-samples"]) == 2
    assert "pass --output FILE.json" in capsys.readouterr().err
    for name in [n for n in sys.modules if n == "lm_eval" or n.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)
    assert main([*hf, "--tasks", "tiny_mc"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == ("shardlm: error: `shardlm eval` needs lm_eval (not installed): "
                                            "pip install 'shardlm[eval]'")


# --- lm-eval's own tasks offline: their data sets live on the HF hub ---------------------------------------

@pytest.fixture(scope="module")
def builtin_tasks(lm_eval_here):
    """lm-eval's task index with its built-in tasks: the scan of its ~14k task YAMLs (~10 s on 2 cores) is the
    slow part of any built-in task's start, so it is made once here and handed to the CLI."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


@pytest.fixture
def hub_off(monkeypatch, tmp_path, builtin_tasks):
    """The hub off wherever datasets and huggingface_hub read it (they read the environment at import), an
    empty datasets cache, and the CLI on the prebuilt task index. Nothing here can wait on the network."""
    import datasets.config
    import huggingface_hub.constants

    from shardlm.cli import eval as eval_cmd

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(eval_cmd, "_task_manager", lambda tasks, include_path: builtin_tasks)
    return tmp_path / "datasets"


def test_a_hub_task_offline_and_not_cached_is_one_line_at_once(assets, hub_off, capsys):
    # before: the model loaded, then datasets' ConnectionError traceback (~45 s of retries when not declared off)
    t0 = time.monotonic()
    rc = main(["eval", "--hf", str(assets["hf"]), "--tasks", "arc_easy,hellaswag", "--limit", "2"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    [line] = err.strip().splitlines()  # no "eval: hf:..." line: the model was never loaded
    assert line.startswith("shardlm: error: 2 tasks need data from the HF hub (arc_easy needs allenai/ai2_arc "
                           f"(ARC-Easy), hellaswag needs Rowan/hellaswag), not in the datasets cache ({hub_off}), "
                           "and the hub is off (HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1); "), line
    assert "HF_DATASETS_CACHE" in line and "--include-path" in line
    assert took < 10, took


def _cache_arc_easy(cache: Path, tmp: Path) -> None:
    """A datasets cache holding allenai/ai2_arc's ARC-Easy config (4 made-up questions), laid out as
    `load_dataset` leaves a hub dataset: prepared by the json builder, then moved to <ns>___<name>/<config>/."""
    import datasets

    row = {"id": "q", "question": "Which is a number?", "choices": {"text": ["4", "x"], "label": ["A", "B"]},
           "answerKey": "A"}
    (tmp / "arc.jsonl").write_text("".join(json.dumps({**row, "id": f"q{i}"}) + "\n" for i in range(4)))
    built = datasets.load_dataset("json", data_files={s: str(tmp / "arc.jsonl") for s in ("train", "validation", "test")},
                                  cache_dir=str(tmp / "json_cache"))
    src = Path(next(iter(built.cache_files.values()))[0]["filename"]).parent
    dst = cache / "allenai___ai2_arc" / "ARC-Easy" / "0.0.0" / "cafe"
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix in (".arrow", ".json"):
            (dst / f.name.replace("json-", "ai2_arc-")).write_bytes(f.read_bytes())
    info = json.loads((dst / "dataset_info.json").read_text())
    (dst / "dataset_info.json").write_text(json.dumps({**info, "config_name": "ARC-Easy", "builder_name": "ai2_arc",
                                                        "dataset_name": "ai2_arc"}))


def test_a_cached_hub_task_runs_offline(assets, hub_off, tmp_path, capsys):
    from shardlm.cli.eval import dataset_cached

    _cache_arc_easy(hub_off, tmp_path)
    assert dataset_cached("allenai/ai2_arc", "ARC-Easy", str(hub_off))
    assert not dataset_cached("allenai/ai2_arc", "ARC-Challenge", str(hub_off))
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        rc = main(["eval", "--hf", str(assets["hf"]), "--tasks", "arc_easy", "--limit", "2", "--bootstrap-iters", "0"])
    assert rc == 0, capsys.readouterr().err[-3000:]
    assert "|arc_easy" in stdout.getvalue()
    # its tag, ai2_arc, holds arc_challenge too, which is not cached: named alone
    assert main(["eval", "--hf", str(assets["hf"]), "--tasks", "ai2_arc"]) == 2
    assert "task arc_challenge needs allenai/ai2_arc (ARC-Challenge) from the HF hub" in capsys.readouterr().err


def test_which_tasks_need_the_hub_and_a_hub_that_does_not_answer(assets, builtin_tasks, hub_off, monkeypatch):
    import datasets.config

    from shardlm.cli.eval import _task_manager, check_hub_data, hub_datasets
    from shardlm.errors import ConfigError

    mmlu = hub_datasets(builtin_tasks, ["mmlu"])  # a group of groups
    assert len(mmlu) == 57 and mmlu["mmlu_anatomy"] == ("cais/mmlu", "anatomy")
    local = _task_manager(["tiny_mc"], str(assets["tasks"]))  # --include-path YAMLs over jsonl files
    assert hub_datasets(local, ["tiny_mc", "tiny_ppl", "tiny_gen"]) == {}
    check_hub_data(local, ["tiny_mc", "tiny_ppl", "tiny_gen"])
    with pytest.raises(ConfigError, match=r"^57 tasks need data from the HF hub \(mmlu_abstract_algebra needs "
                                          r"cais/mmlu \(abstract_algebra\), .*, \.\.\.\), not in"):
        check_hub_data(builtin_tasks, ["mmlu"])
    # not declared off, but nothing answers: asked once, refused at once
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"task arc_easy needs allenai/ai2_arc \(ARC-Easy\) from the HF hub, .* "
                                          r"and http://127.0.0.1:9 does not answer \(.*refused"):
        check_hub_data(builtin_tasks, ["arc_easy"])
