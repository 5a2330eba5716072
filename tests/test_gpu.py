"""The GPU tier: the CUDA paths run for real (``pytest -m gpu``; skipped without CUDA).

Not part of CI (CI has no GPU); ``scripts/gpu-check`` installs the CUDA stack and runs this file.
Every check runs in a fresh spawned process (world size 1 on ``cuda:0`` with nccl, or 2 ranks
where the machine has 2 GPUs) through ``run_distributed``, so process groups and accelerate's
singletons never leak between checks and a hang fails at the timeout. Checks that compare
several configurations run them one after another in one process (one CUDA context, one
fbgemm-gpu load) and cache the results for the tests that read them.
"""

from __future__ import annotations

import os
from typing import Any

import dist_utils
import pytest
import torch
from dist_utils import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,  # every check starts real processes (run_distributed)
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs CUDA"),
]

TIMEOUT = 600
FEATURES = [f"f{i}" for i in range(8)]
NUM_DENSE = 8
ROWS = 5000
DIM = 16
BATCH = 512
TRAIN_BATCHES = 300
EVAL_BATCHES = 40
# fp16/bf16 against fp32 on the planted-signal data: eval AUC may differ by at most this much.
# The model sees 150k rows; the AUC of the same model trained twice from other seeds moves by
# about 0.005 on this data, so 0.01 allows rounding differences but not a broken scaler.
AUC_TOLERANCE = 0.01


# ----------------------------------------------------------------------------- workers
# (module level: spawn pickles them by reference)


def _data() -> tuple[list[Any], list[Any]]:
    from recsys_trainer.data.generators.synthetic import PlantedSignal, synthetic_batches

    sig = PlantedSignal.make(len(FEATURES), NUM_DENSE, ROWS, seed=7, strength=1.0)
    train = synthetic_batches(TRAIN_BATCHES, BATCH, FEATURES, NUM_DENSE, ROWS, seed=1, signal=sig)
    evals = synthetic_batches(EVAL_BATCHES, BATCH, FEATURES, NUM_DENSE, ROWS, seed=2, signal=sig)
    return train, evals


def _model(seed: int = 0) -> Any:
    from recsys_trainer.models import DLRMClassifier

    torch.manual_seed(seed)
    return DLRMClassifier(FEATURES, NUM_DENSE, ROWS, embedding_dim=DIM, dense_arch=(32,),
                          over_arch=(32, 1))


def _tables(trainer: Any) -> dict[str, torch.Tensor]:
    """This rank's table shards (world size 1: whole tables), on the CPU."""
    out = {}
    for name, t in trainer.model.state_dict().items():
        if "embedding_bags" in name:
            shards = t.local_shards() if hasattr(t, "local_shards") else None
            local = shards[0].tensor if shards else t
            out[name] = local.detach().float().cpu().clone()
    return out


def _sharding_types(trainer: Any) -> dict[str, str]:
    types: dict[str, str] = {}
    for module_plan in trainer.model.plan.plan.values():
        for table, ps in module_plan.items():
            types[table] = ps.sharding_type
    return types


def _train_eval(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train one configuration on the planted-signal data and evaluate it; report what the
    tests check (losses, AUC, the fp16 scaler's scale, the plan, table updates)."""
    from recsys_trainer import LambdaHook, SparseOptimizer, Trainer, TrainingArguments
    from recsys_trainer.metrics import weighted_auc
    from recsys_trainer.optimizers import dense_parameters

    train, evals = _data()
    steps = cfg.get("steps", TRAIN_BATCHES)
    losses: list[float] = []
    scales: list[float] = []
    preds: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []

    def after_step(t: Any, out: Any) -> None:
        losses.append(float(out.loss))
        if t.accelerator.scaler is not None:
            scales.append(float(t.accelerator.scaler.get_scale()))

    def after_eval_step(t: Any, out: Any) -> None:
        mb = out.micro_batches[0]
        preds.append(torch.sigmoid(mb.outputs.float()).cpu())
        labels.append(mb.batch.labels.float().cpu())

    trainer = Trainer(
        model=_model(),
        args=TrainingArguments(
            output_dir=cfg["output_dir"], device="cuda", train_steps=steps, log_steps=10**6,
            mixed_precision=cfg.get("mixed_precision", "no"), pipeline=cfg.get("pipeline", "none"),
            sharding_types=cfg.get("sharding_types", {}), resume_from=None, seed=0,
        ),
        train_dataset=train[:steps],
        eval_dataset=evals,
        hooks=[LambdaHook(after_step=after_step, after_eval_step=after_eval_step)],
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=cfg.get("dense_lr", 3e-3)), None),
        sparse_optimizer=SparseOptimizer(cfg.get("sparse", "rowwise_adagrad"),
                                         lr=cfg.get("sparse_lr", 0.05)),
        add_logger_hook=False,
    )
    before = _tables(trainer)
    trainer.train()
    after = _tables(trainer)
    metrics = trainer.evaluate()
    p, y = torch.cat(preds), torch.cat(labels)
    auc = weighted_auc(p, y, torch.ones_like(y))
    fused_state = trainer.optimizer.fused.state_dict()["state"]
    return {
        "losses": losses,
        "scales": scales,
        "auc": auc,
        "eval_loss": metrics["loss"],
        "sharding_types": _sharding_types(trainer),
        "dense_names": [n for n, _ in dense_parameters(trainer.model)],
        "update_norm": sum(float((after[k] - before[k]).norm()) for k in after),
        "tables_finite": all(bool(torch.isfinite(v).all()) for v in after.values()),
        "fused_state_keys": sorted({k for s in fused_state.values() for k in s}),
        "device": str(next(iter(trainer.model.parameters())).device),
    }


def _run_configs(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_train_eval(c) for c in configs]


def _pipeline_vs_plain(out_dir: str) -> dict[str, Any]:
    """The same 40 steps with and without TrainPipelineSparseDist; all parameters after."""
    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments

    train, _ = _data()
    res: dict[str, Any] = {}
    for pipeline in ("none", "sparse_dist"):
        trainer = Trainer(
            model=_model(),
            args=TrainingArguments(output_dir=out_dir, device="cuda", train_steps=40,
                                   pipeline=pipeline, resume_from=None, log_steps=10**6),
            train_dataset=train[:40],
            dense_optimizers=(lambda p: torch.optim.Adam(p, lr=3e-3), None),
            sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
            add_logger_hook=False,
        )
        trainer.train()
        dense = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()
                 if not hasattr(p, "_in_backward_optimizers")}
        res[pipeline] = {"dense": dense, "tables": _tables(trainer), "steps": trainer.state.global_step}
    return res


def _checkpoint_leg(device: str, out_dir: str, load_from: str | None, train_steps: int) -> dict[str, Any]:
    """Train ``train_steps`` (or load ``load_from``), then save; report the live tables."""
    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments

    train, _ = _data()
    trainer = Trainer(
        model=_model(),
        args=TrainingArguments(output_dir=out_dir, device=device, train_steps=max(1, train_steps),
                               resume_from=None, log_steps=10**6),
        train_dataset=train[:max(1, train_steps)],
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=3e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
        add_logger_hook=False,
    )
    if load_from is not None:
        trainer.load_checkpoint(load_from)
    else:
        trainer.train()
    path = trainer.save_checkpoint()
    return {"path": path, "tables": _tables(trainer), "sharding_types": _sharding_types(trainer),
            "device": str(trainer.device), "step": trainer.state.global_step}


def _stream_syncs(out_dir: str) -> dict[str, Any]:
    """Host-device synchronisations per step: the Trainer's loop against a hand-written loop on
    the same model (at world size 1 the gang skips the exit-flag collective, so this part checks
    the rest of the Trainer's step). Per step means the difference between a 30-step and a
    10-step run, so fixed costs of ``train()`` (and the profiler's own start) cancel. Then the
    exit-flag agreement itself, issued on the gloo group while the GPU is busy."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments

    train, _ = _data()
    sync_names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    trainer = Trainer(
        model=_model(),
        args=TrainingArguments(output_dir=out_dir, device="cuda", train_steps=5, resume_from=None,
                               log_steps=10**6),
        train_dataset=train[:5 + 10 + 30],
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=3e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
        add_logger_hook=False,
    )
    trainer.train()  # warm-up (allocations, kernels loaded); the next train() goes on from here

    def count(prof: Any) -> int:
        return sum(e.count for e in prof.key_averages() if e.key in sync_names)

    def trainer_syncs(n: int) -> int:
        trainer.args.train_steps = trainer.state.global_step + n
        torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            trainer.train()
            torch.cuda.synchronize()
        return count(prof)

    model, opt, device = trainer.model, trainer.optimizer.dense, trainer.device

    def loop_syncs(n: int) -> int:
        torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            for b in train[:n]:
                loss, _ = model(b.to(device, non_blocking=True))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        return count(prof)

    t10, t30 = trainer_syncs(10), trainer_syncs(30)
    l10, l30 = loop_syncs(10), loop_syncs(30)

    # The agreement alone, issued while the GPU still runs queued work: a gloo all-reduce of a
    # CPU tensor must return without waiting for the device. At world size 1 the gang skips the
    # collective, so issue exactly what it sends at world size > 1, on its gloo group.
    group = trainer.gang.group  # type: ignore[attr-defined]

    def agree() -> None:
        t = torch.tensor([0, 0, 0, 0], dtype=torch.int32)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)

    def queue_gpu_work() -> None:
        big = torch.randn(8192, 8192, device=device)
        for _ in range(20):
            big = big @ big / 8192.0  # ~20 ms each in fp32 on an H100

    torch.cuda.synchronize()
    queue_gpu_work()
    t0 = time.perf_counter()
    for _ in range(100):
        agree()
    gang_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    queued_s = time.perf_counter() - t1
    def profiled_syncs(calls: int) -> int:
        # The same block with and without the agreement: what the profiler itself adds cancels.
        with profile(activities=acts) as prof:
            torch.cuda.synchronize()
            queue_gpu_work()
            for _ in range(calls):
                agree()
        torch.cuda.synchronize()
        return count(prof)

    gang_syncs = profiled_syncs(100) - profiled_syncs(0)
    return {
        "trainer_per_step": (t30 - t10) / 20, "loop_per_step": (l30 - l10) / 20,
        "trainer_10_30": (t10, t30), "loop_10_30": (l10, l30),
        "gang_syncs": gang_syncs,
        "gang_100_calls_s": gang_s, "gpu_work_left_after_gang_s": queued_s,
        "control_backend": str(torch.distributed.get_backend(group)),
        "model_backend": str(torch.distributed.get_backend()),
    }


def _two_gpu_ranks(out_dir: str) -> dict[str, Any]:
    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments

    rank = int(os.environ["RANK"])
    train, _ = _data()
    trainer = Trainer(
        model=_model(),
        args=TrainingArguments(output_dir=out_dir, device="cuda", train_steps=50 + 10 * rank,
                               resume_from=None, log_steps=10**6),
        train_dataset=train[rank * 100:rank * 100 + 50 + 10 * rank],  # uneven on purpose
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=3e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
        add_logger_hook=False,
    )
    trainer.train()
    dense = {n: p.detach().cpu() for n, p in trainer.model.named_parameters()
             if not hasattr(p, "_in_backward_optimizers")}
    return {"steps": trainer.state.global_step, "dense": dense, "device": str(trainer.device),
            "sharding_types": _sharding_types(trainer)}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def precision_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = str(tmp_path_factory.mktemp("precision"))
    # conftest sets this per test, after module-scoped fixtures run; the whole module is marked.
    dist_utils.current_test_is_distributed = True
    names = ["fp32", "fp16", "bf16", "fp32_sgd", "fp16_sgd"]
    configs = [
        {"output_dir": out},
        {"output_dir": out, "mixed_precision": "fp16"},
        {"output_dir": out, "mixed_precision": "bf16"},
        # Sparse SGD: unlike Adagrad its update is proportional to the gradient's scale, so a
        # loss-scaled gradient reaching the tables unscaled would show as a 65536x larger update.
        {"output_dir": out, "sparse": "sgd", "sparse_lr": 2.0, "steps": 100},
        {"output_dir": out, "sparse": "sgd", "sparse_lr": 2.0, "steps": 100, "mixed_precision": "fp16"},
    ]
    results = run_distributed(_run_configs, 1, TIMEOUT, args=(configs,))[0]
    runs = dict(zip(names, results, strict=True))
    for name, r in runs.items():  # the figures docs/gpu.md quotes, in the -s / -rA output
        print(f"[gpu] {name}: auc={r['auc']:.4f} eval_loss={r['eval_loss']:.4f} "
              f"first/last loss={r['losses'][0]:.4f}/{r['losses'][-1]:.4f} "
              f"scale min/max/last={min(r['scales'], default=0):.0f}/{max(r['scales'], default=0):.0f}/"
              f"{r['scales'][-1] if r['scales'] else 0:.0f} update_norm={r['update_norm']:.4f}")
    return runs


# ----------------------------------------------------------------------------- tests


def test_the_planner_chooses_on_cuda_and_no_table_lands_in_the_dense_optimizer(tmp_path: Any) -> None:
    configs = [
        {"output_dir": str(tmp_path), "steps": 60},
        {"output_dir": str(tmp_path), "steps": 60, "sharding_types": {
            "t_f0": "row_wise", "t_f1": "table_row_wise", "t_f2": "column_wise", "t_f3": "table_wise",
            "t_f4": "table_column_wise"}},
    ]
    free, forced = run_distributed(_run_configs, 1, TIMEOUT, args=(configs,))[0]
    print(f"[gpu] planner's own choice: {free['sharding_types']}")
    print(f"[gpu] with overrides: {forced['sharding_types']}")
    for r in (free, forced):
        assert r["device"].startswith("cuda")
        assert set(r["sharding_types"]) == {f"t_{f}" for f in FEATURES}
        # A data_parallel table is not fused: it would train in the dense optimizer (Adam).
        assert "data_parallel" not in r["sharding_types"].values()
        assert not [n for n in r["dense_names"] if "embedding_bags" in n]
        assert all(map(lambda x: x == x and abs(x) < 1e6, r["losses"]))
        assert sum(r["losses"][-10:]) < sum(r["losses"][:10])
    st = forced["sharding_types"]
    assert (st["t_f0"], st["t_f1"], st["t_f2"], st["t_f3"], st["t_f4"]) == (
        "row_wise", "table_row_wise", "column_wise", "table_wise", "table_column_wise")


@pytest.mark.parametrize("optimizer", ["adam", "lamb", "partial_rowwise_adam", "partial_rowwise_lamb"])
def test_cuda_only_fused_optimizers_train_the_tables_and_keep_their_state(tmp_path: Any, optimizer: str) -> None:
    cfg = {"output_dir": str(tmp_path), "sparse": optimizer, "sparse_lr": 0.01, "steps": 150}
    r = run_distributed(_run_configs, 1, TIMEOUT, args=([cfg],))[0][0]
    print(f"[gpu] {optimizer}: auc={r['auc']:.4f} loss {r['losses'][0]:.4f}->{r['losses'][-1]:.4f} "
          f"state={r['fused_state_keys']}")
    assert r["tables_finite"] and r["update_norm"] > 0
    assert sum(r["losses"][-20:]) < sum(r["losses"][:20])
    assert r["auc"] > 0.6
    # Adam/LAMB keep first and second moments per table (FBGEMM names them momentum1 and
    # exp_avg_sq): a checkpoint needs both.
    assert any(k.endswith(".momentum1") for k in r["fused_state_keys"]), r["fused_state_keys"]
    assert any(k.endswith(".exp_avg_sq") for k in r["fused_state_keys"]), r["fused_state_keys"]


def test_fp16_matches_fp32_auc_with_no_non_finite_step_and_a_live_scaler(precision_runs: dict[str, Any]) -> None:
    fp32, fp16 = precision_runs["fp32"], precision_runs["fp16"]
    assert fp32["auc"] > 0.65, "the fp32 reference did not learn the planted signal"
    assert abs(fp16["auc"] - fp32["auc"]) <= AUC_TOLERANCE, (fp16["auc"], fp32["auc"])
    assert all(torch.isfinite(torch.tensor(fp16["losses"]))), "a step had a non-finite loss"
    assert fp16["tables_finite"]
    assert len(fp16["scales"]) == TRAIN_BATCHES and min(fp16["scales"]) >= 1.0
    assert not fp32["scales"], "fp32 has no scaler"


def test_fp16_loss_scale_is_removed_before_the_fused_sparse_update(precision_runs: dict[str, Any]) -> None:
    fp32, fp16 = precision_runs["fp32_sgd"], precision_runs["fp16_sgd"]
    # With SGD the table update is proportional to the gradient; a scale of 2**16 left in would
    # make it that much larger (or inf). Rounding in fp16 moves it by a few percent at most.
    ratio = fp16["update_norm"] / fp32["update_norm"]
    print(f"[gpu] fp16/fp32 table update norm with sparse SGD: {ratio:.4f}")
    assert 0.8 < ratio < 1.25, ratio
    assert fp16["tables_finite"]


def test_bf16_matches_fp32_auc(precision_runs: dict[str, Any]) -> None:
    fp32, bf16 = precision_runs["fp32"], precision_runs["bf16"]
    assert abs(bf16["auc"] - fp32["auc"]) <= AUC_TOLERANCE, (bf16["auc"], fp32["auc"])
    assert all(torch.isfinite(torch.tensor(bf16["losses"])))


def test_train_pipeline_sparse_dist_gives_the_same_parameters_as_the_plain_loop_on_cuda(tmp_path: Any) -> None:
    res = run_distributed(_pipeline_vs_plain, 1, TIMEOUT, args=(str(tmp_path),))[0]
    plain, piped = res["none"], res["sparse_dist"]
    assert plain["steps"] == piped["steps"] == 40
    worst = 0.0
    for group in ("dense", "tables"):
        for name in plain[group]:
            diff = float((plain[group][name] - piped[group][name]).abs().max())
            worst = max(worst, diff)
    print(f"[gpu] pipeline vs plain loop, max |diff| over all parameters after 40 steps: {worst:.3g}")
    assert worst <= 1e-5


def test_a_checkpoint_saved_on_the_gpu_resumes_on_the_cpu_and_back_bitwise(tmp_path: Any) -> None:
    from recsys_trainer.checkpoint.export import export_model_state_dict, read_full, saved_keys

    gpu = run_distributed(_checkpoint_leg, 1, TIMEOUT, args=("cuda", str(tmp_path / "gpu"), None, 25))[0]
    cpu = run_distributed(_checkpoint_leg, 1, TIMEOUT, args=("cpu", str(tmp_path / "cpu"), gpu["path"], 0),
                          env={"CUDA_VISIBLE_DEVICES": ""})[0]
    back = run_distributed(_checkpoint_leg, 1, TIMEOUT, args=("cuda", str(tmp_path / "back"), cpu["path"], 0))[0]
    print(f"[gpu] plans: gpu {gpu['sharding_types']} / cpu {cpu['sharding_types']}")
    assert gpu["device"].startswith("cuda") and cpu["device"] == "cpu" and back["device"].startswith("cuda")
    assert gpu["step"] == cpu["step"] == back["step"] == 25
    for name, t in gpu["tables"].items():
        assert torch.equal(t, cpu["tables"][name]), name
        assert torch.equal(t, back["tables"][name]), name
    # The files too: model and both optimizers' state, bitwise, through all three checkpoints.
    exports = [export_model_state_dict(leg["path"]) for leg in (gpu, cpu, back)]
    assert exports[0].keys() == exports[1].keys() == exports[2].keys()
    for k in exports[0]:
        assert torch.equal(exports[0][k], exports[1][k]) and torch.equal(exports[0][k], exports[2][k]), k
    optim_keys = {k for k in saved_keys(gpu["path"]) if k.startswith("optim.")}
    assert any("momentum1" in k for k in optim_keys), "row-wise Adagrad state is in the checkpoint"
    states = [read_full(leg["path"], optim_keys) for leg in (gpu, cpu, back)]
    for k in optim_keys:
        a, b, c = (s.get(k) for s in states)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and torch.equal(a, c), k
        else:
            assert a == b == c, k


def test_the_exit_flag_agreement_never_synchronises_the_cuda_stream(tmp_path: Any) -> None:
    r = run_distributed(_stream_syncs, 1, TIMEOUT, args=(str(tmp_path),))[0]
    print(f"[gpu] syncs per step: trainer {r['trainer_per_step']:.2f} (10/30 steps: "
          f"{r['trainer_10_30']}), hand-written loop {r['loop_per_step']:.2f} ({r['loop_10_30']}); "
          f"100 exit-flag all-reduces: {r['gang_syncs']} syncs, {r['gang_100_calls_s'] * 1e3:.1f} ms, "
          f"GPU work still queued after them: {r['gpu_work_left_after_gang_s'] * 1e3:.1f} ms; "
          f"control group {r['control_backend']}, model group {r['model_backend']}")
    assert r["control_backend"] == "gloo" and r["model_backend"] == "nccl"
    assert r["gang_syncs"] == 0
    # The agreement returned while the GPU was still busy: it did not wait for the stream.
    assert r["gpu_work_left_after_gang_s"] > 2 * r["gang_100_calls_s"]
    assert r["trainer_per_step"] <= r["loop_per_step"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="2 ranks need 2 GPUs (nccl refuses 2 ranks on 1 GPU)")
def test_two_ranks_on_two_gpus_agree_on_the_dense_model_with_uneven_data(tmp_path: Any) -> None:
    res = run_distributed(_two_gpu_ranks, 2, TIMEOUT, args=(str(tmp_path),))
    assert res[0]["steps"] == res[1]["steps"] == 50
    assert {res[0]["device"], res[1]["device"]} == {"cuda:0", "cuda:1"}
    for name in res[0]["dense"]:
        assert torch.equal(res[0]["dense"][name], res[1]["dense"][name]), name


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host has a GPU per rank")
def test_two_ranks_on_one_gpu_are_refused_at_start_with_what_to_do(tmp_path: Any) -> None:
    # nccl cannot run two ranks on one device (and rank 1 has no cuda:1): both ranks must say
    # so at once instead of failing inside nccl or hanging.
    with pytest.raises(AssertionError, match="each rank needs its own GPU"):
        run_distributed(_two_gpu_ranks, 2, 120, args=(str(tmp_path),))
