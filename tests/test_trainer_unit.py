"""Single-process behaviour of the Trainer, its arguments and hooks."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import Recorder, batches, make_trainer, tiny_model

from recsys_trainer import (
    Hook,
    LambdaHook,
    SparseOptimizer,
    Trainer,
    TrainingArguments,
    supported_sparse_optimizers,
)
from recsys_trainer.data.base import WindowedDataset
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.inputs import SparseFeature
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.distributed import FakeGang
from recsys_trainer.hooks.base import HookList
from recsys_trainer.models import DLRMClassifier


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("train_steps", 0, "`train_steps` must be an int >= 1 or None, but is 0."),
        ("train_epoch", -1, "`train_epoch` must be an int >= 1, but is -1."),
        ("gradient_accumulation_steps", 0, "`gradient_accumulation_steps` must be an int >= 1"),
        ("log_steps", 2.5, "`log_steps` must be an int >= 1 or None, but is 2.5."),
        ("max_grad_norm", -1.0, "`max_grad_norm` must be a number > 0 or None, but is -1.0."),
        ("mixed_precision", "fp8", "`mixed_precision` must be one of 'no', 'bf16', 'fp16', but is 'fp8'."),
        ("device", "tpu", "`device` must be one of 'auto', 'cpu', 'cuda', but is 'tpu'."),
        ("output_dir", "", "`output_dir` must be a non-empty path string"),
        ("sharding_types", {"t_f0": "diagonal"}, "`sharding_types['t_f0']` must be one of"),
        ("collective_timeout_s", 0, "`collective_timeout_s` must be a number > 0, but is 0."),
    ],
)
def test_invalid_training_arguments_name_the_field_value_and_range(field, value, message) -> None:
    with pytest.raises(ValueError) as err:
        TrainingArguments(**{field: value})
    assert message in str(err.value)


def test_pipeline_with_accumulation_or_fp16_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="needs `gradient_accumulation_steps` = 1, but that is 2"):
        TrainingArguments(pipeline="sparse_dist", gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="cannot be combined with `mixed_precision` 'fp16'"):
        TrainingArguments(pipeline="sparse_dist", mixed_precision="fp16")
    with pytest.raises(ValueError, match="`pipeline` must be one of 'none', 'sparse_dist', but is 'async'"):
        TrainingArguments(pipeline="async")  # type: ignore[arg-type]


def test_pipelined_training_stops_at_exactly_train_steps_and_evaluates_afterwards() -> None:
    trainer = make_trainer(train=batches(10), eval_=batches(2, seed=3), pipeline="sparse_dist",
                           train_steps=4)
    trainer.train()
    assert trainer.state.global_step == 4 and trainer.state.batches_in_window == 4
    assert math.isfinite(trainer.evaluate()["loss"])  # the model's own forward is restored


def test_unsupported_sparse_optimizer_on_cpu_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="not supported by FBGEMM on cpu; supported there: sgd, adagrad, rowwise_adagrad"):
        SparseOptimizer("adam").check_device("cpu")
    assert supported_sparse_optimizers("cuda")[:3] == ["sgd", "adagrad", "rowwise_adagrad"]
    with pytest.raises(ValueError, match="`sparse_optimizer.name` must be one of"):
        SparseOptimizer("adamw")
    with pytest.raises(ValueError, match="`sparse_optimizer.lr` must be a number > 0"):
        SparseOptimizer("sgd", lr=0)


def test_trainer_refuses_adam_for_tables_on_cpu() -> None:
    with pytest.raises(ValueError, match="sparse optimizer 'adam' is not supported by FBGEMM on cpu"):
        make_trainer(train=batches(2), sparse=SparseOptimizer("adam"), device="cpu")


def test_fp16_on_cpu_is_refused_with_the_alternative() -> None:
    with pytest.raises(ValueError, match="needs CUDA .* on CPU use 'bf16' or 'no'"):
        make_trainer(train=batches(2), mixed_precision="fp16", device="cpu")


def test_row_wise_sharding_on_cpu_is_refused_with_the_cpu_choices() -> None:
    with pytest.raises(ValueError, match="which needs CUDA; on CPU use one of table_wise, column_wise, data_parallel"):
        make_trainer(train=batches(2), sharding_types={"t_f0": "row_wise"}, device="cpu")


def test_sharding_override_for_an_unknown_table_names_the_known_tables() -> None:
    with pytest.raises(ValueError, match=r"names tables \['nope'\].*its tables: \['t_f0'"):
        make_trainer(train=batches(2), sharding_types={"nope": "table_wise"})


def test_dense_optimizer_holding_embedding_tables_is_refused() -> None:
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # Table params are on the meta device before sharding, but the optimizer holds them.
    with pytest.raises(ValueError, match="the dense optimizer holds"):
        Trainer(model=model, args=TrainingArguments(), train_dataset=batches(2),
                dense_optimizers=(opt, None), add_logger_hook=False)


def test_dense_optimizer_gets_exactly_the_parameters_without_a_fused_optimizer() -> None:
    trainer = make_trainer(train=batches(2))
    dense_ids = {id(p) for g in trainer.optimizer.dense.param_groups for p in g["params"]}
    named = dict(trainer.model.named_parameters())
    tables = {n for n in named if "embedding_bags" in n}
    assert tables, "expected sharded table parameters"
    assert dense_ids == {id(p) for n, p in named.items() if n not in tables}
    assert all(hasattr(named[n], "_in_backward_optimizers") for n in tables)


def test_train_steps_gives_exactly_that_many_optimizer_steps() -> None:
    seen: list[int] = []
    trainer = make_trainer(
        train=batches(10), train_steps=7, train_epoch=5,
        hooks=[LambdaHook(after_step=lambda t, out: seen.append(out.step))],
    )
    trainer.train()
    assert trainer.state.global_step == 7
    assert seen == list(range(1, 8))


def test_train_epoch_walks_the_data_that_many_times() -> None:
    trainer = make_trainer(train=batches(4), train_epoch=3)
    trainer.train()
    assert trainer.state.global_step == 12
    assert trainer.state.epoch == 3


def test_gradient_accumulation_counts_optimizer_steps_and_closes_partial_steps() -> None:
    steps: list[int] = []
    trainer = make_trainer(
        train=batches(7), gradient_accumulation_steps=3,
        hooks=[LambdaHook(after_step=lambda t, out: steps.append(len(out.micro_batches)))],
    )
    trainer.train()
    # 7 micro-batches -> 3 + 3 + 1 (the window's last step is partial, not dropped)
    assert steps == [3, 3, 1]
    assert trainer.state.global_step == 3


def test_event_sequence_of_train() -> None:
    rec = Recorder()
    trainer = make_trainer(train=batches(2), train_epoch=2, hooks=[rec])
    trainer.train()
    step = ["before_step", "after_data", "after_step"]
    epoch0 = ["before_epoch(0)", "before_window(all)", *step[:2], "after_step(1)", *step[:2],
              "after_step(2)", "out_of_data(all,0)", "after_window(all)", "after_epoch(0)"]
    epoch1 = ["before_epoch(1)", "before_window(all)", *step[:2], "after_step(3)", *step[:2],
              "after_step(4)", "out_of_data(all,0)", "after_window(all)", "after_epoch(1)"]
    assert rec.events == ["before_train", *epoch0, *epoch1, "after_train", "end"]


def test_event_sequence_of_evaluate() -> None:
    rec = Recorder()
    trainer = make_trainer(train=batches(1), eval_=batches(2, seed=9), hooks=[rec])
    metrics = trainer.evaluate()
    ev = ["after_data", "before_eval_step", "after_eval_step(1)", "after_data", "before_eval_step",
          "after_eval_step(2)"]
    assert rec.events == ["before_evaluate", "before_window(all)", *ev, "out_of_data(all,0)",
                          "after_window(all)", "after_evaluate", "end"]
    assert metrics["num_samples"] == 64 and math.isfinite(metrics["loss"])


def test_event_sequence_of_train_and_evaluate_fires_end_once() -> None:
    rec = Recorder()
    trainer = make_trainer(train=batches(1), eval_=batches(1, seed=9), hooks=[rec], train_epoch=2)
    trainer.train_and_evaluate()
    one_epoch = lambda e, s: [  # noqa: E731
        f"before_epoch({e})", "before_window(all)", "before_step", "after_data", f"after_step({s})",
        "out_of_data(all,0)", "after_window(all)", f"after_epoch({e})",
        "before_evaluate", "before_window(all)", "after_data", "before_eval_step",
        "after_eval_step(1)", "out_of_data(all,0)", "after_window(all)", "after_evaluate",
    ]
    assert rec.events == ["before_train", *one_epoch(0, 1), *one_epoch(1, 2), "after_train", "end"]
    assert rec.events.count("end") == 1


def test_exception_fires_on_exception_then_end_and_propagates() -> None:
    rec = Recorder()

    def boom(trainer, out):  # noqa: ANN001
        if out.step == 2:
            raise RuntimeError("boom")

    trainer = make_trainer(train=batches(4), hooks=[LambdaHook(after_step=boom), rec])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert rec.events[-2:] == ["on_exception", "end"]
    assert "after_train" not in rec.events


def test_a_hook_can_request_a_stop_after_the_current_step() -> None:
    def stop_at_3(trainer, out):  # noqa: ANN001
        if out.step == 3:
            trainer.request_stop("enough")

    trainer = make_trainer(train=batches(10), hooks=[LambdaHook(after_step=stop_at_3)])
    trainer.train()
    assert trainer.state.global_step == 3
    assert trainer.state.stop_reason == "enough"


def test_evaluate_uses_the_model_in_memory_after_train() -> None:
    data = batches(30, seed=1)
    held_out = batches(4, seed=2)
    trainer = make_trainer(train=data, eval_=held_out, train_epoch=2)
    before = trainer.evaluate()["loss"]
    trainer.train()
    after = trainer.evaluate()["loss"]
    assert after < before - 0.02, (before, after)


def test_hooks_run_in_list_order_and_only_for_overridden_events() -> None:
    calls: list[str] = []
    a = LambdaHook(before_train=lambda t: calls.append("a"))
    b = LambdaHook(before_train=lambda t: calls.append("b"))
    hl = HookList([a, b])
    assert not hl.has("after_step") and hl.has("before_train")
    hl.fire("before_train", None)
    assert calls == ["a", "b"]
    with pytest.raises(ValueError, match="unknown hook events"):
        LambdaHook(after_stepp=lambda t, o: None)


def test_lr_of_both_optimizers_is_readable_and_follows_the_scheduler() -> None:
    trainer = Trainer(
        model=tiny_model(),
        args=TrainingArguments(log_steps=1000),
        train_dataset=batches(4),
        dense_optimizers=(
            lambda p: torch.optim.SGD(p, lr=0.1),
            lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        ),
        sparse_optimizer=SparseOptimizer("sgd", lr=0.05),
        add_logger_hook=False,
    )
    assert trainer.dense_lr() == pytest.approx(0.1)
    assert trainer.sparse_lr() == pytest.approx(0.05)
    trainer.train()
    assert trainer.dense_lr() == pytest.approx(0.1 * 0.5**4)


def test_bf16_autocast_trains_on_cpu() -> None:
    trainer = make_trainer(train=batches(4), mixed_precision="bf16")
    trainer.train()
    assert trainer.state.global_step == 4


def test_grad_clipping_bounds_the_dense_update() -> None:
    # With SGD, lr 1 and max norm 1e-3, no dense parameter can move by more than 1e-3 in total.
    trainer = make_trainer(train=batches(1), dense_sgd=True, dense_lr=1.0, max_grad_norm=1e-3)
    before = [p.detach().clone() for p in trainer.dense_params]
    trainer.train()
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(trainer.dense_params, before, strict=True)])
    assert 0 < moved.norm().item() <= 1e-3 + 1e-7


def test_fake_gang_plays_another_rank_running_out_of_data() -> None:
    # The peer reports out_of_data on the third fetch: training stops after 2 steps though this
    # rank has 5 batches, and the rows it fetched but did not train are counted. Each vector is
    # [4 flags, rows fetched by rank 0 (this one), rows fetched by rank 1 (the peer)].
    peer = [[0, 1, 0, 0, 0, 10], [0, 1, 0, 0, 0, 10], [1, 0, 0, 0, 0, 0]]
    rec = Recorder()
    trainer = make_trainer(train=batches(5, batch_size=16), hooks=[rec])
    trainer.gang = FakeGang(rank=0, world_size=2, peer_max=peer)
    trainer.train()
    assert trainer.state.global_step == 2
    assert "out_of_data(all,48)" in rec.events  # the fetched batch + the 2 left = 3 x 16 rows
    assert trainer.state.rows_unread == 48
    assert trainer.state.rows_seen == 2 * (16 + 10)  # both ranks' rows of the 2 steps trained


class _LoggedWindows(WindowedDataset):
    """Windows of in-memory batches that log when each window id is produced and read."""

    def __init__(self, n: int, log: list[str]) -> None:
        self._n, self._log = n, log
        self._data = {f"w{i}": batches(2, seed=i) for i in range(n)}

    def window_ids(self):  # noqa: ANN201
        for i in range(self._n):
            self._log.append(f"appeared w{i}")
            yield f"w{i}"

    def iter_window(self, window_id: str, skip_batches: int = 0):  # noqa: ANN201
        self._log.append(f"read {window_id}")
        return iter(self._data[window_id][skip_batches:])


def test_windows_are_walked_lazily_so_a_stream_trains_each_window_when_it_appears() -> None:
    log: list[str] = []
    trainer = make_trainer(train=_LoggedWindows(3, log), window_iter=2)
    trainer.train()
    assert log == ["appeared w0", "read w0", "appeared w1", "read w1"]
    assert trainer.state.global_step == 4


def test_prior_ctr_starts_the_output_at_the_base_rate_and_is_validated() -> None:
    from recsys_trainer.models import DLRMClassifier

    m = DLRMClassifier(["a"], 2, 10, embedding_dim=4, dense_arch=(4,), over_arch=(4, 1), prior_ctr=0.01)
    last = [x for x in m.dlrm.over_arch.modules() if isinstance(x, torch.nn.Linear)][-1]
    assert torch.sigmoid(last.bias).item() == pytest.approx(0.01)
    with pytest.raises(ValueError, match=r"`prior_ctr` must be in \(0, 1\), but is 1.5"):
        DLRMClassifier(["a"], 2, 10, embedding_dim=4, dense_arch=(4,), over_arch=(4, 1), prior_ctr=1.5)


@pytest.mark.parametrize("pipeline", ["none", "sparse_dist"])
@pytest.mark.parametrize("cut", ["train_steps", "eval_steps"])
def test_a_window_cut_short_releases_the_readers_background_thread(tmp_path, pipeline, cut) -> None:
    import threading

    from data_utils import row_id_spec, write_windows

    from recsys_trainer.data.parquet import ParquetWindowDataset

    write_windows(str(tmp_path), [[400]])

    def ds() -> ParquetWindowDataset:
        return ParquetWindowDataset(str(tmp_path), row_id_spec(), batch_size=4, prefetch_batches=2)

    before = set(threading.enumerate())
    trainer = Trainer(
        model=DLRMClassifier(["item", "tag"], 1, [100, 50], embedding_dim=4, dense_arch=(4,), over_arch=(4, 1)),
        args=TrainingArguments(output_dir=str(tmp_path / "out"), train_steps=3, eval_steps=2,
                               pipeline=pipeline, log_steps=1000),
        train_dataset=ds(), eval_dataset=ds(), add_logger_hook=False,
    )
    trainer.train() if cut == "train_steps" else trainer.evaluate()
    leaked = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    for t in leaked:
        t.join(timeout=5)
    assert not [t.name for t in leaked if t.is_alive()]


def test_more_ranks_than_gpus_on_a_host_is_refused_naming_both_counts() -> None:
    from recsys_trainer.distributed import check_one_gpu_per_rank

    assert check_one_gpu_per_rank(local_rank=1, local_world_size=2, num_gpus=2) == 1
    with pytest.raises(ValueError, match=r"runs 2 ranks \(this is local rank 1\) but has 1 visible CUDA device"):
        check_one_gpu_per_rank(local_rank=1, local_world_size=2, num_gpus=1)
    with pytest.raises(ValueError, match="nproc_per_node=1"):
        check_one_gpu_per_rank(local_rank=0, local_world_size=2, num_gpus=1)
    # A launcher that gives each process one GPU of its own (CUDA_VISIBLE_DEVICES per process).
    assert check_one_gpu_per_rank(local_rank=1, local_world_size=2, num_gpus=1, visible_devices="3") == 0
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        check_one_gpu_per_rank(local_rank=1, local_world_size=4, num_gpus=2, visible_devices="0,1")


def _parquet_data(sparse: list[tuple[str, int]]) -> ParquetWindowDataset:
    spec = FeatureSpec(labels=["y"], dense=["d0", "d1"],
                       sparse=[SparseFeature(name=n, num_embeddings=k) for n, k in sparse])
    return ParquetWindowDataset([], spec, batch_size=8)


def _dlrm(features: list[str], rows: list[int]) -> DLRMClassifier:
    return DLRMClassifier(features, 2, rows, embedding_dim=4, dense_arch=(4,), over_arch=(4, 1))


def test_a_feature_bound_larger_than_its_table_is_refused_at_construction_naming_both_sizes() -> None:
    data = _parquet_data([("user", 100), ("item_id", 5000)])
    with pytest.raises(ValueError) as e:
        Trainer(_dlrm(["user", "item_id"], [100, 1000]), TrainingArguments(), train_dataset=data)
    msg = str(e.value)
    assert "sparse feature 'item_id' holds ids in [0, 5000)" in msg
    assert "'t_item_id', has 1000 rows" in msg
    # The eval dataset is checked too; a smaller bound than the table is fine.
    with pytest.raises(ValueError, match="'item_id' holds ids in \\[0, 5000\\)"):
        Trainer(_dlrm(["user", "item_id"], [100, 1000]), TrainingArguments(),
                train_dataset=_parquet_data([("user", 100), ("item_id", 10)]), eval_dataset=data)
    Trainer(_dlrm(["user", "item_id"], [100, 1000]), TrainingArguments(),
            train_dataset=_parquet_data([("user", 50), ("item_id", 1000)]), add_logger_hook=False)


def test_model_features_missing_from_the_spec_are_refused_naming_both_sets() -> None:
    data = _parquet_data([("user", 100), ("item", 100), ("extra", 7)])
    with pytest.raises(ValueError) as e:
        Trainer(_dlrm(["user", "item_id"], [100, 100]), TrainingArguments(), train_dataset=data)
    assert ("tables read sparse features ['item_id', 'user'], but the data's FeatureSpec declares "
            "['extra', 'item', 'user']: ['item_id'] missing") in str(e.value)


def test_the_bundled_model_refuses_labels_outside_0_1_naming_the_value() -> None:
    data = batches(3)
    data[1].labels[5] = 2.0
    trainer = make_trainer(train=data)
    with pytest.raises(ValueError, match=r"label 2 is outside \[0, 1\] \(1 such label\(s\) in this batch\), "
                                         r"but this model's loss \(binary cross-entropy\)"):
        trainer.train()
    assert trainer.state.global_step == 1  # refused at the batch, before its backward
    data[1].labels[5] = -1.0
    with pytest.raises(ValueError, match="label -1 is outside"):
        make_trainer(eval_=data).evaluate()


def test_a_label_outside_0_1_is_named_by_column_file_and_row_without_a_label_range(tmp_path) -> None:
    import dataclasses

    import pyarrow as pa
    import pyarrow.parquet as pq
    from data_utils import row_id_spec, write_windows

    write_windows(str(tmp_path), [[8]])
    f = str(tmp_path / "hour=00" / "part-0.parquet")
    t = pq.read_table(f)
    pq.write_table(t.set_column(t.schema.get_field_index("y"), "y",
                                pa.array([0.0, 1.0, 0.0, 1.0, 0.0, 2.0, 0.0, 1.0], pa.float32())), f)
    ds = ParquetWindowDataset(str(tmp_path), row_id_spec(), batch_size=4)
    assert ds.features.label_range is None  # the user set none: the bundled model's [0, 1] applies
    trainer = _row_id_trainer(ds)
    with pytest.raises(DataError, match=rf"file {f}, row group 0, row 5, column 'y': label 2 is outside "
                                        r"label_range \[0, 1\]"):
        trainer.train()
    assert trainer.state.global_step == 0
    # A range the user set is theirs (the loss still refuses what it cannot take).
    mine = ParquetWindowDataset(str(tmp_path), dataclasses.replace(row_id_spec(), label_range=(0, 2)),
                                batch_size=4)
    _row_id_trainer(mine)
    assert mine.features.label_range == (0.0, 2.0)


def test_a_label_range_given_by_one_model_does_not_stay_with_the_dataset_for_the_next(tmp_path) -> None:
    """The Trainer gives the model's label_range to a spec that sets none; a dataset used again
    with a model without one (a regression model, after a classifier refused its labels) must
    read as its user declared it, not refuse labels in the first model's name."""
    import dataclasses

    from data_utils import row_id_spec, write_windows

    def without_label_range(ds: ParquetWindowDataset) -> None:
        model = DLRMClassifier(["item", "tag"], 1, [100, 50], embedding_dim=4, dense_arch=(4,),
                               over_arch=(4, 1))
        model.label_range = None  # as a model of the user's that declares none
        Trainer(model, TrainingArguments(output_dir=str(tmp_path / "o"), resume_from=None),
                train_dataset=ds, add_logger_hook=False)

    write_windows(str(tmp_path), [[8]])
    ds = ParquetWindowDataset(str(tmp_path), row_id_spec(), batch_size=4)
    _row_id_trainer(ds)
    assert ds.features.label_range == (0.0, 1.0)
    without_label_range(ds)
    assert ds.features.label_range is None
    _row_id_trainer(ds)  # and given again
    assert ds.features.label_range == (0.0, 1.0)
    # A range the user set stays, whatever the models.
    own = ParquetWindowDataset(str(tmp_path), dataclasses.replace(row_id_spec(), label_range=(0, 5)),
                               batch_size=4)
    _row_id_trainer(own)
    without_label_range(own)
    assert own.features.label_range == (0.0, 5.0)


def _row_id_trainer(train: object, **args: object) -> Trainer:
    from data_utils import row_id_spec

    spec = row_id_spec()
    model = DLRMClassifier(spec.sparse_names, spec.num_dense, [s.num_embeddings for s in spec.sparse],
                           embedding_dim=4, dense_arch=(4,), over_arch=(4, 1))
    return Trainer(model, TrainingArguments(output_dir="/tmp/recsys_trainer_test", resume_from=None,
                                            **args),  # type: ignore[arg-type]
                   train_dataset=train, add_logger_hook=False)


def test_training_that_trains_nothing_is_an_error_naming_the_source(tmp_path) -> None:
    from data_utils import row_id_spec, write_windows

    spec = row_id_spec()
    nothing = ParquetWindowDataset([str(tmp_path / "2019-*/*.parquet")], spec, batch_size=4)
    with pytest.raises(DataError, match=r"training ran 0 steps: the train data, ParquetWindowDataset over "
                                        r"'.*2019-\*/\*.parquet', lists no window"):
        _row_id_trainer(nothing).train()
    write_windows(str(tmp_path / "empty"), [[0], [0]])  # two windows, zero rows each
    with pytest.raises(DataError, match=r"listed 2 window\(s\) that held no batch to train"):
        _row_id_trainer(ParquetWindowDataset(str(tmp_path / "empty"), spec, batch_size=4)).train()
    # Another rank with no rows at all: this one trained nothing either, and says what it left.
    trainer = make_trainer(train=batches(2))
    trainer.gang = FakeGang(rank=0, world_size=2, peer_max=[[1, 0, 0, 0, 0, 0]])
    with pytest.raises(DataError, match=r"held no batch to train on every rank \(this rank left 64 rows unread"):
        trainer.train()


def test_zero_steps_are_fine_when_asked_for_or_already_done() -> None:
    stop = LambdaHook(before_train=lambda t: t.request_stop("nothing today"))
    trainer = make_trainer(train=batches(2), hooks=[stop])
    trainer.train()
    assert trainer.state.global_step == 0 and trainer.state.stop_reason == "nothing today"
    done = make_trainer(train=batches(2), train_steps=2)
    done.train()
    done.train()  # a second call at train_steps: nothing left to do
    assert done.state.global_step == 2


def test_host_memory_is_the_smallest_of_the_cgroup_limit_and_physical_ram(tmp_path) -> None:
    from recsys_trainer.distributed import usable_memory_bytes

    physical, source = usable_memory_bytes(str(tmp_path / "none"), str(tmp_path / "none"))
    assert source == "physical memory" and physical > 2**30
    proc = tmp_path / "cgroup"
    (tmp_path / "job").mkdir()
    proc.write_text("0::/job\n")
    (tmp_path / "job" / "memory.max").write_text("max\n")  # v2 "no limit"
    assert usable_memory_bytes(str(tmp_path), str(proc)) == (physical, "physical memory")
    (tmp_path / "job" / "memory.max").write_text(f"{2**30}\n")
    assert usable_memory_bytes(str(tmp_path), str(proc)) == (
        2**30, f"cgroup v2 memory.max ({tmp_path}/job/memory.max)")
    proc.write_text("4:memory:/other\n1:cpu:/\n")  # v1, limit set on the namespace's root
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # "no limit"
    assert usable_memory_bytes(str(tmp_path), str(proc))[0] == physical
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{3 * 2**30}\n")
    assert usable_memory_bytes(str(tmp_path), str(proc)) == (
        3 * 2**30, f"cgroup v1 memory.limit_in_bytes ({tmp_path}/memory/memory.limit_in_bytes)")


def test_tables_larger_than_the_memory_this_process_may_use_are_refused_before_allocating(
        monkeypatch) -> None:
    import recsys_trainer.sharding as sharding

    monkeypatch.setattr(sharding, "usable_memory_bytes", lambda: (256 << 20, "cgroup v2 memory.max (/fake)"))
    model = DLRMClassifier(["a", "b"], 2, [3_000_000, 100], embedding_dim=32, dense_arch=(32,), over_arch=(4, 1))
    with pytest.raises(ValueError) as e:
        Trainer(model, TrainingArguments(), train_dataset=batches(1), add_logger_hook=False)
    msg = str(e.value)
    assert "the embedding tables do not fit in host memory: 2 table(s) hold 0.36 GiB of weights" in msg
    assert "the largest 't_a' (3,000,000 x 32 = 0.36 GiB of weights)" in msg
    assert ("each of the 1 rank(s) on this host may use 0.25 GiB of host memory (cgroup v2 memory.max "
            "(/fake): 0.25 GiB). Refused before allocating anything.") in msg


def test_a_dynamic_table_takes_any_raw_id_so_its_feature_bound_is_not_checked() -> None:
    from recsys_trainer.dynamic import ID_SPACE, DynamicTable
    from recsys_trainer.sharding import check_data_fits_model, feature_tables

    model = DLRMClassifier(["user", "item"], 2, 100, embedding_dim=4, dense_arch=(4,),
                           over_arch=(4, 1), dynamic=DynamicTable(num_slots=64, buckets=1))
    assert sorted(feature_tables(model)) == [("item", "t_item", None), ("user", "t_user", None)]
    check_data_fits_model(model, [_parquet_data([("user", ID_SPACE), ("item", ID_SPACE)])])
    with pytest.raises(ValueError, match=r"\['item'\] missing"):
        check_data_fits_model(model, [_parquet_data([("user", ID_SPACE)])])


def test_a_misspelled_event_method_is_refused_naming_the_event_it_resembles() -> None:
    class Typo(Hook):
        def after_train_step(self, trainer, output) -> None:  # type: ignore[no-untyped-def]
            raise AssertionError("never called: not an event")

    class Helper(Hook):
        def after_step(self, trainer, output) -> None:  # type: ignore[no-untyped-def]
            self._after_reporting()

        def _after_reporting(self) -> None:
            pass

    with pytest.raises(TypeError, match=r"Typo defines after_train_step\(\).*'after_step'"):
        HookList([Typo()])
    assert HookList([Helper()]).has("after_step")


@pytest.mark.parametrize(("bad_id", "why"), [
    (200, "outside table 't_f2', which has rows [0, 200) (1 such id(s) of 'f2' in this batch)"),
    (-3, "it is negative, and no table row is (1 such id(s) of 'f2' in this batch)"),
])
def test_a_hand_built_batch_with_an_id_outside_its_table_is_refused_before_it_trains(bad_id, why) -> None:
    # Unchecked, FBGEMM logs "Setting idx to zero" and trains the id on row 0.
    data = batches(3)
    kjt = data[1].sparse
    kjt.values()[kjt.offset_per_key()[2] + 7] = bad_id  # feature f2, row 7
    trainer = make_trainer(train=data)
    with pytest.raises(DataError) as e:
        trainer.train()
    assert str(e.value) == (
        f"window 'all', batch 1: feature 'f2' (batch.sparse) has id {bad_id} at row 7: {why}. "
        "Unchecked, FBGEMM would train it on row 0; map ids into the table before building the "
        "batch (hash them, or take them modulo 200), or give the table more rows (num_embeddings).")
    assert trainer.state.global_step == 1  # refused at the fetch, before the batch trained
    with pytest.raises(DataError, match="window 'all', batch 1: feature 'f2'"):
        make_trainer(eval_=data).evaluate()


def test_a_hand_built_batch_missing_a_feature_or_with_float_ids_is_named(tmp_path) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys_trainer.batch import Batch

    data = batches(2)
    b = data[1]
    jts = b.sparse.to_dict()
    data[1] = Batch(dense=b.dense, labels=b.labels, sparse=KeyedJaggedTensor.from_jt_dict(
        {k: jts[k] for k in ("f0", "f1", "f3")}))
    with pytest.raises(DataError, match=(
            r"window 'all', batch 1: table 't_f2' reads feature 'f2', but the batch has no such key "
            r"where it looks \(a pooled table \(EmbeddingBagCollection\), which reads batch.sparse; "
            r"the batch has batch.sparse keys \['f0', 'f1', 'f3'\]\)")):
        make_trainer(train=data).train()

    data = batches(2)
    data[1].sparse._values = data[1].sparse.values().float()
    with pytest.raises(DataError, match=r"batch 1: batch.sparse holds torch.float32 values"):
        make_trainer(train=data).train()

    # predict checks the batches it scores the same way.
    data = batches(2)
    data[1].sparse.values()[0] = 10**6
    with pytest.raises(DataError, match="batch 1: feature 'f0' .* has id 1000000 at row 0"):
        make_trainer(train=batches(1)).predict(data, str(tmp_path / "scores"))


def test_hand_built_batches_of_a_dynamic_table_take_any_raw_id_but_a_negative_one() -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys_trainer.batch import Batch
    from recsys_trainer.dynamic import DynamicTable

    def batch(user_ids: list[int]) -> Batch:
        n = len(user_ids)
        return Batch(dense=torch.zeros(n, 2), labels=torch.ones(n), sparse=KeyedJaggedTensor(
            keys=["user", "item"], values=torch.tensor([*user_ids, *range(n)]),
            lengths=torch.ones(2 * n, dtype=torch.int32), stride=n))

    model = DLRMClassifier(["user", "item"], 2, 100, embedding_dim=4, dense_arch=(4,),
                           over_arch=(4, 1), dynamic={"user": DynamicTable(num_slots=64, buckets=1)})
    trainer = Trainer(model, TrainingArguments(output_dir="/tmp/recsys_trainer_test"),
                      train_dataset=[batch([2**62 + 5, 2**63 - 2]), batch([7, -1])],
                      add_logger_hook=False)
    with pytest.raises(DataError, match=r"batch 1: feature 'user' \(batch.sparse\) has id -1 at "
                                        r"row 1: it is negative, .* raw ids of dynamic table 't_user' must be >= 0"):
        trainer.train()
    assert trainer.state.global_step == 1


def test_ids_that_never_train_are_not_checked() -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys_trainer.batch import Batch

    # A key no table reads is never looked up: any value passes.
    data = batches(3)
    b = data[0]
    jts = b.sparse.to_dict()
    n = b.batch_size
    jts["request"] = KeyedJaggedTensor(keys=["request"], values=torch.full((n,), -5),
                                       lengths=torch.ones(n, dtype=torch.int32)).to_dict()["request"]
    data[0] = Batch(dense=b.dense, labels=b.labels, sparse=KeyedJaggedTensor.from_jt_dict(jts))
    # A batch left unread when training stops early is counted, not checked (a check there
    # would raise on this rank alone, after the ranks agreed to stop).
    data[2].sparse.values()[0] = 999
    trainer = make_trainer(train=data, hooks=[LambdaHook(
        after_step=lambda t, out: t.request_stop("enough") if out.step == 1 else None)])
    trainer.train()
    assert trainer.state.global_step == 1
    assert trainer._train_it is not None
    assert trainer._train_it.state.rows_unread == 2 * 32  # batch 1 (fetched), batch 2 (counted)

