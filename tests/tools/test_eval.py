"""`hf-scatter eval`: lm-eval parity of vanilla vs patched on tiny checkpoints, offline; a broken backend
fails with the table showing where; the `hf-scatter` lm-eval model resolves through lm-eval's registry."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra: make test installs it")

import hf_scatter.eval  # noqa: E402  (registers the hf-scatter models with lm-eval)
from hf_scatter.cli import main as cli_main  # noqa: E402
from hf_scatter.conversion import convert  # noqa: E402
from hf_scatter.eval.backends import BACKENDS, Backend  # noqa: E402
from hf_scatter.eval.suite import DATA_DIR, TASKS, generated_sums, load_data, read_rows  # noqa: E402
from hf_scatter.tiny import tiny_dbrx, tiny_mixtral  # noqa: E402

FP32 = ["--dtype", "float32", "--device", "cpu"]
# --ll-tolerance is per scored token. A float32 model's log-probabilities are scored in float64, so what two
# correct implementations leave is their float32 arithmetic inside the model: one float32 ulp of a
# log-probability of the tiny vocabulary's size (|log p| ~ ln 384 ~ 6, in [4, 8): ulp 2**-21) per token.
# A different float32 summation order in every matmul measured 2e-8 to 6e-8 per token; one expert's output
# scaled by 1.001 moves some requests by 1e-6 to 5e-6 per token (test_ll_tolerance_...).
LL_PER_TOKEN = 2.0 ** -21
LL = ["--ll-tolerance", str(LL_PER_TOKEN)]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("eval") / "mixtral"
    tiny_mixtral().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def no_network(monkeypatch):
    """Any outgoing connection fails the test: the harness must run fully offline."""
    attempts = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(address)
        raise OSError(f"network access attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


def _eval(args, tmp_path, capsys) -> tuple[int, dict | None, str]:
    out = tmp_path / "report.json"
    rc = cli_main(["eval", *args, "--out", str(out)])
    report = json.loads(out.read_text()) if out.exists() else None
    return rc, report, capsys.readouterr()


@pytest.mark.kernel_bodies("reference")
def test_mixtral_converted_layout_parity_fp32_offline(mixtral_dir, tmp_path, capsys, no_network):
    converted = tmp_path / "mixtral-hf-scatter"
    convert(mixtral_dir, str(converted), progress=False)
    plot = tmp_path / "parity.png"
    rc, report, out = _eval(["--model", str(converted), *FP32, "--limit", "3", *LL,
                             "--plot", str(plot)], tmp_path, capsys)
    assert rc == 0, out.out + out.err
    assert report["passed"] and not no_network
    assert report["tasks"] == list(TASKS)
    assert any("scattermoe" in impl for impl in report["backends"][1]["patch_report"]), report["backends"]
    assert report["backends"][0]["patch_report"] == []
    metrics = {(m["task"], m["metric"]) for m in report["metrics"]}
    for task, metric in [("hfs_arithmetic", "acc"), ("hfs_facts", "acc_norm"), ("hfs_perplexity", "word_perplexity"),
                         ("hfs_perplexity", "byte_perplexity"), ("hfs_perplexity", "bits_per_byte"),
                         ("hfs_generation", "exact_match")]:
        assert (task, metric) in metrics
    summary = report["summary"]["patched"]
    assert summary["ll_requests"] == 3 * 4 + 3 * 4 + 3 * 2 + 3  # choices of 3 docs per MC task + 3 paragraphs
    assert summary["ll_max_per_token"] <= LL_PER_TOKEN and report["scoring_dtype"] == "float64"
    assert summary["decisions_changed"] == 0 and summary["generations"] == 3
    assert "PASS" in out.out and "| hfs_perplexity | bits_per_byte |" in out.out
    assert plot.stat().st_size > 0


@pytest.mark.kernel_bodies("reference")
def test_dbrx_parity_fp32(tmp_path, tokenizer, capsys):
    path = tmp_path / "dbrx"
    tiny_dbrx().save_pretrained(path)
    tokenizer.save_pretrained(path)
    rc, report, out = _eval(["--model", str(path), *FP32, "--limit", "2", *LL,
                             "--tasks", "hfs_facts,hfs_perplexity,hfs_generation"], tmp_path, capsys)
    assert rc == 0, out.out + out.err
    assert report["model_type"] == "dbrx" and report["summary"]["patched"]["ll_max_per_token"] <= LL_PER_TOKEN
    assert report["backends"][1]["patch_report"], "the patched backend must run hf-scatter's modules"


# The harness is under test in this file: the kernels run their torch reference; the kernels' own tests and the
# family suite of test_models.py hold the interpreted kernels to float64 references and to vanilla generate, and
# every offloaded family's greedy tokens (interpreted) are held to generate's in tests/offload.
# One family per kind of layer the harness's three backends meet: Llama-style softmax routing (also OLMoE's,
# Qwen2-MoE's and Granite's), latent attention with group-limited routing and a dense first layer (also
# DeepSeek-V2's), biases, sinks and sliding windows (GPT-OSS).
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.kernel_bodies("reference")
def test_fine_grained_families_parity_fp32(family, tmp_path, capsys):
    """Each family's random checkpoint: patched (its router, norms, RoPE and experts) and offloaded (CGOPipe on
    the CPU stand-in) equal vanilla request by request, log-likelihoods and greedy generations alike."""
    rc, report, out = _eval(["--random", f"tiny-{family}", *FP32, "--limit", "2", *LL,
                             "--tasks", "hfs_facts,hfs_generation", "--backends", "vanilla,patched,offloaded"],
                            tmp_path, capsys)
    assert rc == 0, out.out + out.err
    assert report["model_type"] == family
    for backend in ("patched", "offloaded"):
        summary = report["summary"][backend]
        assert summary["ll_max_per_token"] <= LL_PER_TOKEN and summary["generations"] > 0
        assert summary["generations_changed"] == 0
    assert any("scattermoe" in i for i in report["backends"][1]["patch_report"])
    assert any(r.startswith(f"offloaded: OffloadedModel({family}") for r in report["backends"][2]["patch_report"])


def _perturbed(settings):
    """vanilla with noise on the expert weights: what a broken kernel would look like from outside."""
    lm = BACKENDS["vanilla"].build(settings)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if ".experts." in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return lm


@pytest.mark.kernel_bodies("reference")
def test_broken_backend_fails_and_the_table_shows_where(mixtral_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(BACKENDS, "perturbed", Backend("perturbed", "perturbed", _perturbed))
    rc, report, out = _eval(["--model", mixtral_dir, *FP32, "--limit", "3", "--backends", "vanilla,perturbed",
                             *LL, "--tasks", "hfs_arithmetic,hfs_perplexity"], tmp_path, capsys)
    assert rc == 1 and not report["passed"]
    bad_rows = {(m["task"], m["metric"]) for m in report["metrics"] if not m["ok"]}
    assert ("hfs_perplexity", "bits_per_byte") in bad_rows
    assert all(not r["ok"] and r["ll_max_per_token"] > LL_PER_TOKEN for r in report["requests"])
    table_row = next(line for line in out.out.splitlines() if line.startswith("| hfs_perplexity | bits_per_byte |"))
    assert table_row.endswith("**NO** |")
    assert "FAIL:" in out.out and "hfs_perplexity bits_per_byte: perturbed" in out.out


def _reassociated(settings):
    """vanilla with every linear layer summing its inner dimension in another order (chunks of 7, last first):
    what another processor's BLAS does, and nothing a parity check should call a difference."""
    import torch.nn.functional as F

    lm = BACKENDS["vanilla"].build(settings)
    linear, model_call = F.linear, lm._model_call

    def reassociated(x, w, b=None):
        parts = [linear(x[..., s:s + 7], w[:, s:s + 7]) for s in range(0, x.shape[-1], 7)]
        out = sum(parts[::-1][1:], parts[-1])
        return out if b is None else out + b

    def call(*args, **kwargs):
        F.linear = reassociated
        try:
            return model_call(*args, **kwargs)
        finally:
            F.linear = linear

    lm._model_call = call
    return lm


def _one_expert_scaled(settings):
    """vanilla with expert 0 of layer 0 giving 1.001 times its output: a real, small kernel error."""
    lm = BACKENDS["vanilla"].build(settings)
    with torch.no_grad():
        lm.model.get_parameter("model.layers.0.mlp.experts.down_proj")[0].mul_(1.001)
    return lm


@pytest.mark.kernel_bodies("reference")
def test_ll_tolerance_passes_another_summation_order_and_fails_a_scaled_expert(mixtral_dir, tmp_path, capsys,
                                                                              monkeypatch):
    """The per-token tolerance holds on any processor: float32 sums in another order pass (under an absolute
    1e-4 per request with float32 scoring, they failed: 1.22e-4 on a paragraph), a 0.1% error fails."""
    monkeypatch.setitem(BACKENDS, "reassociated", Backend("reassociated", "reassociated", _reassociated))
    monkeypatch.setitem(BACKENDS, "scaled", Backend("scaled", "scaled", _one_expert_scaled))
    rc, report, out = _eval(["--model", mixtral_dir, *FP32, "--limit", "3", *LL, "--backends",
                             "vanilla,reassociated,scaled", "--tasks", "hfs_facts,hfs_word_order,hfs_perplexity"],
                            tmp_path, capsys)
    assert rc == 1 and report["scoring_dtype"] == "float64"
    rows = {(r["task"], r["backend"]): r for r in report["requests"]}
    other_order = report["summary"]["reassociated"]
    assert other_order["ll_max_abs"] > 0, "the reassociated sums must differ from vanilla's, or nothing is tested"
    assert all(rows[(task, "reassociated")]["ok"] for task in report["tasks"])
    assert not all(rows[(task, "scaled")]["ok"] for task in report["tasks"])
    assert all(f.split(":")[1].strip().startswith("scaled") for f in report["failures"] if "per token" in f)


def test_ll_tolerance_scales_with_the_tokens_summed_and_the_scoring_dtype():
    from hf_scatter.eval.compare import BackendRun, compare

    def run(name, values):
        requests = [{"doc_id": i, "idx": 0, "value": v, "tokens": n} for i, (v, n) in enumerate(values)]
        return BackendRun(name, name, 0.0, {"t": {}}, {"t": "loglikelihood_rolling"}, {"t": requests})

    two_ulps = 2 * 2.0 ** -14  # of a float32 sum in [512, 1024)
    ref = run("ref", [(-600.0, 250), (-3.0, 1)])
    moved = run("moved", [(-600.0 + two_ulps, 250), (-3.0 + two_ulps, 1)])
    float64_sums = compare([ref, moved], 0.006, 1e-6, roundoff=2.0 ** -53)["requests"][0]
    assert float64_sums["ll_tokens"] == [250, 1] and not float64_sums["ok"]  # the one-token request fails
    long_only = compare([run("ref", [(-600.0, 250)]), run("moved", [(-600.0 + two_ulps, 250)])], 0.006, 1e-6,
                        roundoff=2.0 ** -53)
    assert long_only["passed"], "1.2e-4 over 250 tokens is 4.9e-7 per token"
    strict = compare([run("ref", [(-600.0, 250)]), run("moved", [(-600.0 + two_ulps, 250)])], 0.006, 1e-7,
                     roundoff=2.0 ** -53)
    assert not strict["passed"]
    float32_sums = compare([run("ref", [(-600.0, 250)]), run("moved", [(-600.0 + two_ulps, 250)])], 0.006, 1e-7,
                           roundoff=2.0 ** -24)
    assert float32_sums["passed"], "two roundings of a float32 sum of 250 terms may move it by far more"


def test_a_family_hf_scatter_does_not_patch_is_refused_before_any_model_loads(tmp_path, tokenizer, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=tokenizer.vocab_size)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    rc, report, out = _eval(["--model", str(path), *FP32, "--limit", "2"], tmp_path, capsys)
    assert rc == 2 and report is None
    assert "backend patched: model_type 'llama' (LlamaModel) is not supported. Supported: bert, dbrx" in out.err
    assert "loading" not in out.err, "the reference backend loaded before the refusal"


def test_eager_backend_needs_interface_experts(tmp_path, tokenizer, capsys):
    path = tmp_path / "dbrx"
    tiny_dbrx(layers=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    rc, report, out = _eval(["--model", str(path), *FP32, "--backends", "eager,vanilla"], tmp_path, capsys)
    assert rc == 2 and "experts_implementation switch" in out.err and "DbrxForCausalLM" in out.err


@pytest.mark.kernel_bodies("reference")
def test_offloaded_backend_matches_vanilla_request_by_request(mixtral_dir, tmp_path, capsys):
    """The checkpoint through hf_scatter.offload (the same pipeline on the CPU): fp32 log-likelihoods and
    greedy generations equal transformers'."""
    rc, report, out = _eval(["--model", mixtral_dir, *FP32, "--limit", "3", *LL,
                             "--backends", "vanilla,offloaded"], tmp_path, capsys)
    assert rc == 0, out.out + out.err
    assert any(r.startswith("offloaded: OffloadedModel(mixtral") for r in report["backends"][1]["patch_report"])
    summary = report["summary"]["offloaded"]
    assert summary["ll_requests"] == 3 * 4 + 3 * 4 + 3 * 2 + 3 and summary["ll_max_per_token"] <= LL_PER_TOKEN
    assert summary["decisions_changed"] == 0 and summary["generations"] == 3 and summary["generations_changed"] == 0


@pytest.mark.parametrize("shape", ["tiny-bert", "tiny-qwen3_next"])
def test_offloaded_backend_refuses_other_families_before_any_model_loads(shape, tmp_path, capsys):
    rc, report, out = _eval(["--random", shape, *FP32, "--backends", "vanilla,offloaded"], tmp_path, capsys)
    assert rc == 2 and report is None
    assert "backend offloaded: the offloaded backend runs the causal MoE families dbrx, deepseek_v2, deepseek_v3, " \
        in out.err
    assert "loading" not in out.err, "a model loaded before the refusal"


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/ckpt"], "not a checkpoint directory"),
    (["--tasks", "hfs_facts,no_such_task"], "unknown task(s) no_such_task; bundled: hfs_all, hfs_arithmetic"),
    (["--backends", "vanilla"], "at least two different backends"),
    ([], "give a checkpoint with --model DIR, or --random SHAPE"),
])
def test_bad_input_names_the_problem(mixtral_dir, tmp_path, capsys, args, message):
    if "--model" not in args and args:
        args = ["--model", mixtral_dir, *args]
    rc, report, out = _eval([*args, *FP32], tmp_path, capsys)
    assert rc == 2 and report is None
    assert message in out.err


def test_missing_lm_eval_says_how_to_install_it(mixtral_dir, tmp_path, capsys, monkeypatch):
    import importlib.metadata as md

    real = md.version

    def version(name):
        if name == "lm_eval":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "version", version)
    rc, report, out = _eval(["--model", mixtral_dir, *FP32], tmp_path, capsys)
    assert rc == 2 and "pip install 'hf-scatter[eval]'" in out.err


def test_hf_scatter_model_loads_through_lm_eval_registry(mixtral_dir):
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM

    from hf_scatter.eval.lm_model import HFScatterLM

    cls = get_model("hf-scatter")
    assert cls is HFScatterLM and issubclass(cls, HFLM)
    assert get_model("hf") is HFLM, "registering hf-scatter must not hide lm-eval's own models"
    lm = cls.create_from_arg_string(f"pretrained={mixtral_dir},dtype=float32,device=cpu,norms=False")
    impls = set(lm.patch_report.values())
    assert any("scattermoe" in i for i in impls) and "fused_add_norm" not in impls
    with pytest.raises(TypeError, match="moe must be True or False"):
        cls.create_from_arg_string(f"pretrained={mixtral_dir},device=cpu,moe=maybe")


def test_declared_entry_points_name_the_registered_classes():
    """lm-eval releases with plugin discovery load these entry points; they must be the registered classes."""
    tomllib = pytest.importorskip("tomllib")
    from importlib.metadata import EntryPoint

    from lm_eval.api.registry import get_model

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"]["lm_eval.models"]
    assert declared == hf_scatter.eval.LM_EVAL_MODELS
    for name, target in declared.items():
        assert EntryPoint(name=name, value=target, group="lm_eval.models").load() is get_model(name)


def test_this_environment_runs_the_lm_eval_startup_hook():
    """make's editable install puts lm-eval's startup hook in place too: this interpreter ran it when it started,
    and hf-scatter's models are declared where it looks (the whole `lm_eval run --model hf-scatter` command, from
    an installed wheel, runs in tests/tools/test_packaging.py)."""
    from importlib.metadata import entry_points

    import _hf_scatter_lm_eval

    assert any(isinstance(f, _hf_scatter_lm_eval._AfterImport) for f in sys.meta_path), "the .pth hook did not run"
    names = {point.name for point in entry_points(group=_hf_scatter_lm_eval.GROUP)}
    assert {"hf-scatter", "hf-scatter-mlm", "hf-scatter-offloaded"} <= names, names


@pytest.mark.kernel_bodies("reference")
def test_bert_is_scored_by_pseudo_log_likelihood_and_skips_generation(tmp_path, capsys):
    rc, report, out = _eval(["--random", "tiny-bert", *FP32, "--limit", "2", *LL,
                             "--tasks", "hfs_facts,hfs_generation"], tmp_path, capsys)
    assert rc == 0, out.out + out.err
    assert report["scoring"].startswith("pseudo-log-likelihood") and report["tasks"] == ["hfs_facts"]
    assert "hfs_generation" in report["skipped_tasks"]
    assert report["backends"][1]["patch_report"]


def test_masked_lm_batching_matches_one_masked_forward_per_token(tmp_path):
    from hf_scatter.eval.masked_lm import MaskedLMScorer
    from hf_scatter.eval.random_checkpoint import save_random_checkpoint

    save_random_checkpoint("tiny-bert", str(tmp_path / "bert"), dtype=torch.float32)
    scorer = MaskedLMScorer(str(tmp_path / "bert"), dtype="float32", batch_size=3, patch=False)
    pairs = [("The cat", " sat on the mat."), ("A", " b"), ("Water boils at", " 100 degrees")]
    requests = [((c, x), scorer.tok_encode(c), scorer.tok_encode(x)) for c, x in pairs]
    scores = scorer._loglikelihood_tokens(requests, disable_tqdm=True)
    for (_, ctx, cont), (score, _) in zip(requests, scores):
        ids = torch.tensor([ctx + cont])
        expected = 0.0
        for pos in range(len(ctx), len(ctx) + len(cont)):
            masked = ids.clone()
            masked[0, pos] = scorer.tokenizer.mask_token_id
            with torch.no_grad():
                logits = scorer.model(input_ids=masked).logits[0, pos]
            expected += torch.log_softmax(logits, -1)[ids[0, pos]].item()
        assert score == pytest.approx(expected, abs=1e-4)


def test_bundled_suite_loads_from_any_directory_and_user_tasks_join(tmp_path, monkeypatch):
    from hf_scatter.eval.runner import resolve_tasks

    monkeypatch.chdir(tmp_path)  # data paths resolve against the package, not the working directory
    assert len(load_data("facts.jsonl")["test"]) == len(read_rows("facts.jsonl"))
    for file in ("arithmetic.jsonl", "facts.jsonl", "word_order.jsonl"):
        rows = read_rows(file)
        assert len(rows) >= 24 and all(0 <= r["answer"] < len(r["choices"]) for r in rows)
    assert {p.name for p in DATA_DIR.iterdir()} >= {"paragraphs.jsonl", "generation.jsonl"}
    sums = generated_sums()["test"]
    assert len(sums) == 1000 and sums[:5] == generated_sums(count=5)["test"][:5]  # same seed, same documents
    for row in sums.select(range(50)):
        a, b = (int(w.rstrip("?")) for w in row["question"].split()[2::2])
        assert int(row["choices"][row["answer"]]) == a + b and len(set(row["choices"])) == 4
    user = tmp_path / "my_tasks"
    user.mkdir()
    (user / "rows.jsonl").write_text('{"q": "Two plus two is", "choices": [" four", " five"], "answer": 0}\n')
    (user / "my_loader.py").write_text(
        "import datasets, json, pathlib\n"
        "def load(**_):\n"
        "    rows = [json.loads(l) for l in (pathlib.Path(__file__).parent / 'rows.jsonl').open()]\n"
        "    return datasets.DatasetDict({'test': datasets.Dataset.from_list(rows)})\n")
    (user / "my_task.yaml").write_text(
        "task: my_task\ncustom_dataset: !function my_loader.load\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    leaves, manager, skipped = resolve_tasks(["my_task", "hfs_all"], [str(user)], builtin_tasks=False, encoder=False)
    assert leaves == ["my_task", *TASKS] and not skipped
    assert len(list(manager.load(["my_task"])["tasks"]["my_task"].test_docs())) == 1


@pytest.mark.gpu
def test_gpu_bf16_fine_grained_qwen3_shape_within_the_metric_tolerance(tmp_path, capsys):
    """Qwen3-30B-A3B's published shape (128 experts of 768, top-8), 2 layers, random bf16 weights."""
    rc, report, out = _eval(["--random", "qwen3-30b-a3b", "--dtype", "bfloat16", "--device", "cuda", "--limit", "200",
                             "--tasks", "hfs_sums,hfs_perplexity", "--batch-size", "32"], tmp_path, capsys)
    assert rc == 0, out.out + out.err
    assert all(m["ok"] for m in report["metrics"]) and report["tolerance"]["metric"] == 0.006
    assert any("scattermoe" in i for i in report["backends"][1]["patch_report"])


@pytest.mark.gpu
def test_gpu_bf16_parity_sits_at_transformers_own_noise_floor(tmp_path, capsys):
    """Triton kernels in bf16: per-request differences of the order of transformers' eager vs grouped_mm."""
    rc, report, out = _eval(["--random", "tiny-mixtral", "--dtype", "bfloat16", "--device", "cuda", "--limit", "300",
                             "--tasks", "hfs_sums,hfs_perplexity", "--backends", "vanilla,eager,patched",
                             "--batch-size", "32"], tmp_path, capsys)
    assert rc in (0, 1), out.err
    floor, ours = report["summary"]["eager"], report["summary"]["patched"]
    assert any("scattermoe" in i for i in report["backends"][2]["patch_report"])
    assert ours["ll_mean_abs"] <= 3 * max(floor["ll_mean_abs"], 1e-3), out.out
    assert ours["decisions_changed"] <= max(3, 3 * floor["decisions_changed"]), out.out


def _shipped_checkpoint(shipped: str, path) -> None:
    from hf_scatter.models.fp8_experts import save_fp8_checkpoint
    from hf_scatter.models.mxfp4_experts import save_mxfp4_checkpoint
    from hf_scatter.tiny import tiny_decoder

    if shipped == "MXFP4":
        save_mxfp4_checkpoint(tiny_decoder("gpt_oss", seed=5), path)
    else:
        save_fp8_checkpoint(tiny_decoder("qwen3_moe", seed=5), path, block=(32, 32))


@pytest.mark.kernel_bodies("reference")  # the kernels against float64: tests/kernels/test_mxfp4.py, test_fp8_blocks.py
@pytest.mark.parametrize("shipped", ["MXFP4", "FP8"])
def test_quantized_checkpoint_as_shipped_matches_transformers_own_load(tmp_path, capsys, tokenizer, shipped,
                                                                        monkeypatch):
    """A GPT-OSS checkpoint with MXFP4 experts, or a block-scaled FP8 Qwen3-MoE one: `--model hf` loads it
    dequantized (no hub kernels), `hf-scatter` keeps the weights as shipped (the kernels read the bytes); both compute
    with the same values, so request by request they agree. FP8 takes the route a GPU without transformers' Hub FP8
    kernel takes: transformers' own loader with ``dequantize=True``, named in the report."""
    path = tmp_path / shipped
    _shipped_checkpoint(shipped, path)
    tokenizer.save_pretrained(path)
    if shipped == "FP8":
        monkeypatch.setattr(hf_scatter.eval.backends, "_fp8_kernel_missing", lambda settings: "no kernel in this test")
    rc, report, out = _eval(["--model", str(path), *FP32, "--limit", "2", *LL, "--tasks", "hfs_facts,hfs_generation"],
                            tmp_path, capsys)
    assert rc == 0, out.out + out.err
    summary = report["summary"]["patched"]
    assert summary["ll_max_per_token"] <= LL_PER_TOKEN and summary["generations"] > 0
    assert summary["generations_changed"] == 0
    assert any(shipped in impl for impl in report["backends"][1]["patch_report"]), report["backends"]
    if shipped == "FP8":
        assert report["backends"][0]["loaded_as"] == "FP8 dequantized by transformers (no kernel in this test)"
        assert "vanilla loaded as: FP8 dequantized by transformers" in out.out


@pytest.mark.gpu
@pytest.mark.parametrize("shipped, products", [("MXFP4", None), ("FP8", "0"), ("FP8", None)],
                         ids=["MXFP4", "FP8-W8A16", "FP8-W8A8"])
def test_gpu_bf16_quantized_checkpoint_parity(tmp_path, capsys, tokenizer, monkeypatch, shipped, products):
    """A quantized checkpoint in bf16 on the GPU against transformers' own load of it (FP8 dequantized by its loader
    where its Hub kernel is missing). Where our kernels compute with the checkpoint's values (MXFP4, FP8 weights
    decoded in registers) per-request differences sit at transformers' own noise floor (eager vs its default
    experts). FP8 prefill by default multiplies FP8 products: the activations rounded to e4m3 per 128 columns, as
    transformers' own FP8 kernel and DeepSeek-V3 do, which a bf16 reference does not; it must stay within the
    harness's metric tolerance and move at most a few near-tied decisions."""
    if products is not None:
        monkeypatch.setenv("HF_SCATTER_FP8_PRODUCTS", products)
    path = tmp_path / shipped
    _shipped_checkpoint(shipped, path)
    tokenizer.save_pretrained(path)
    rc, report, out = _eval(["--model", str(path), "--dtype", "bfloat16", "--device", "cuda", "--limit", "200",
                             "--tasks", "hfs_sums,hfs_perplexity", "--backends", "vanilla,eager,patched",
                             "--batch-size", "32"], tmp_path, capsys)
    assert rc in (0, 1), out.err
    floor, ours = report["summary"]["eager"], report["summary"]["patched"]
    assert any(shipped in impl for impl in report["backends"][2]["patch_report"]), report["backends"]
    assert ours["decisions_changed"] <= max(3, 3 * floor["decisions_changed"]), out.out
    if shipped == "FP8" and products is None:
        assert rc == 0 and report["passed"], out.out
    else:
        assert ours["ll_mean_abs"] <= 3 * max(floor["ll_mean_abs"], 1e-3), out.out
