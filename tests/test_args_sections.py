"""``TrainingArguments`` nested by concern (``checkpoint``, ``eval``, ``logging``) with every flat
RecIS-style key still accepted, readable and writable (issue 36, "settings by concern")."""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import json
import pickle
from pathlib import Path

import pytest

from recsys_trainer.args import (
    FLAT_ALIASES,
    SECTIONS,
    CheckpointArguments,
    EvalArguments,
    LoggingArguments,
    ModelBankSource,
    TrainingArguments,
)
from recsys_trainer.periods import Period

# The flat keys of every section, with a non-default value each (valid on its own).
FLAT = {
    "save_steps": 2, "save_every_n_windows": 3, "save_every_n_epochs": 4, "save_end": True,
    "save_every_n_event_seconds": 60.0,
    "max_to_keep": 7, "save_concurrency_per_rank": 2, "params_not_save": ["t_user"],
    "model_bank": [{"path": "/tmp/bank"}], "resume_from": None, "async_save": False,
    "keep_every_n_hours": 1.5, "keep_best_metric": "auc", "keep_best_mode": "max",
    "reshard_data_position": "next_window",
    "eval_steps": 5, "eval_every_n_windows": 2,
    "logging_dir": "/tmp/logs", "log_every_n_rows": 1000,
}
# What FLAT leaves out: a second period of a kind FLAT sets, or a callable.
LEFT_OUT = {"save_every_n_rows", "save_filter_fn", "eval_every_n_steps", "eval_every_n_rows",
            "eval_every_n_epochs", "log_steps"}


def by_section(flat: dict[str, object]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {name: {} for name in SECTIONS}
    for key, value in flat.items():
        out[FLAT_ALIASES[key]][key] = value
    return out


def test_flat_aliases_are_the_sections_fields() -> None:
    assert set(SECTIONS) == {"checkpoint", "eval", "logging"}
    for name, cls in SECTIONS.items():
        assert {k for k, s in FLAT_ALIASES.items() if s == name} == {
            f.name for f in dataclasses.fields(cls)}
    assert set(FLAT) | LEFT_OUT == set(FLAT_ALIASES)
    own = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert not own & set(FLAT_ALIASES)
    assert {"checkpoint", "eval", "logging"} <= own


def test_flat_keywords_and_sections_give_equal_arguments() -> None:
    flat = TrainingArguments(output_dir="/tmp/o", train_steps=9, **FLAT)  # type: ignore[arg-type]
    sections = by_section(FLAT)
    nested = TrainingArguments(
        output_dir="/tmp/o", train_steps=9,
        checkpoint=CheckpointArguments(**sections["checkpoint"]),  # type: ignore[arg-type]
        eval=EvalArguments(**sections["eval"]),  # type: ignore[arg-type]
        logging=LoggingArguments(**sections["logging"]),  # type: ignore[arg-type]
    )
    as_dicts = TrainingArguments(output_dir="/tmp/o", train_steps=9, **sections)  # type: ignore[arg-type]
    assert flat == nested == as_dicts
    for key, value in FLAT.items():
        assert getattr(flat, key) == value
        assert getattr(getattr(flat, FLAT_ALIASES[key]), key) == value
    assert flat.eval_period == Period(2, "windows") == flat.eval.period
    assert flat.log_period == Period(1000, "rows") == flat.logging.period
    assert flat.log_steps is None  # no default when log_every_n_rows is set
    assert flat.local_log_dir == "/tmp/logs"
    # The defaults are the sections' (100-step logging when no log period is given).
    default = TrainingArguments()
    assert default == TrainingArguments(checkpoint={}, eval={}, logging={})  # type: ignore[arg-type]
    assert default.log_steps == 100 and default.logging.log_steps == 100
    assert default.log_period == Period(100, "steps") and default.eval_period is None
    assert default.checkpoint == CheckpointArguments() and default.resume_from == "auto"
    assert TrainingArguments(checkpoint=None) == default  # type: ignore[arg-type]  # YAML `checkpoint:`


def test_flat_attributes_write_through_to_the_section() -> None:
    args = TrainingArguments(save_steps=2)
    args.save_steps = 5
    args.log_steps = 7
    assert args.checkpoint.save_steps == 5 and args.logging.log_steps == 7
    args.checkpoint.max_to_keep = 1
    assert args.max_to_keep == 1


def test_a_flat_key_overrides_the_same_field_of_a_section_given_alongside() -> None:
    section = CheckpointArguments(save_steps=2, max_to_keep=3)
    args = TrainingArguments(checkpoint=section, save_steps=10, log_steps=4,
                             logging={"logging_dir": "/tmp/l"})  # type: ignore[arg-type]
    assert args.checkpoint.save_steps == 10 and args.checkpoint.max_to_keep == 3
    assert args.logging == LoggingArguments(logging_dir="/tmp/l", log_steps=4)
    assert section.save_steps == 2  # the given section is not changed
    # A flat key over a section's field is validated together with the section's others.
    with pytest.raises(ValueError, match="the save period is given 2 ways"):
        TrainingArguments(checkpoint={"save_steps": 2}, save_every_n_rows=100)  # type: ignore[arg-type]


def test_dataclasses_replace_takes_flat_keys_and_copies_the_sections() -> None:
    args = TrainingArguments(save_steps=2, eval_every_n_steps=3, log_every_n_rows=50)
    changed = dataclasses.replace(args, save_steps=None, save_every_n_rows=1000,
                                  eval_every_n_steps=None, eval_every_n_epochs=1,
                                  log_steps=1, log_every_n_rows=None, train_steps=4)
    assert (changed.save_steps, changed.save_every_n_rows) == (None, 1000)
    assert changed.eval_period == Period(1, "epochs") and changed.log_period == Period(1, "steps")
    assert changed.train_steps == 4
    # The original is untouched and shares no section with the copy.
    assert (args.save_steps, args.eval_every_n_steps, args.log_every_n_rows) == (2, 3, 50)
    for name in SECTIONS:
        assert getattr(changed, name) is not getattr(args, name)
    same = dataclasses.replace(args)
    assert same == args and all(getattr(same, n) is not getattr(args, n) for n in SECTIONS)
    # replace re-validates, with today's messages.
    with pytest.raises(ValueError, match=r"`save_steps` must be an int >= 1 or None, but is 0\."):
        dataclasses.replace(args, save_steps=0)
    # (As before nesting: log_steps and log_every_n_rows are exclusive, also through replace.)
    with pytest.raises(ValueError, match="the log period is given 2 ways"):
        dataclasses.replace(TrainingArguments(), log_every_n_rows=10)


def test_a_section_given_is_copied_never_shared() -> None:
    section = CheckpointArguments(save_steps=2)
    a = TrainingArguments(checkpoint=section)
    b = TrainingArguments(checkpoint=section)
    assert a.checkpoint is not section and b.checkpoint is not section
    assert a.checkpoint is not b.checkpoint
    a.save_steps = 8
    assert (section.save_steps, b.save_steps) == (2, 2)
    # Default sections are fresh per instance; copy.copy copies them too.
    c, d = TrainingArguments(), TrainingArguments()
    assert all(getattr(c, n) is not getattr(d, n) for n in SECTIONS)
    e = copy.copy(a)
    e.save_steps = 9
    assert a.save_steps == 8 and e.checkpoint is not a.checkpoint
    assert copy.deepcopy(a) == a and pickle.loads(pickle.dumps(a)) == a


def test_unknown_keys_are_named() -> None:
    with pytest.raises(TypeError, match=r"TrainingArguments.__init__\(\) got an unexpected keyword "
                                        r"argument 'save_stepz'"):
        TrainingArguments(save_stepz=2)  # type: ignore[call-arg]
    with pytest.raises(ValueError) as err:
        TrainingArguments(checkpoint={"save_stepz": 2, "max_to_keep": 1})  # type: ignore[arg-type]
    msg = str(err.value)
    assert msg.startswith("unknown key `checkpoint.save_stepz`; allowed keys in `checkpoint`: "
                          "save_steps, save_every_n_rows,")
    assert "reshard_data_position." in msg
    with pytest.raises(ValueError, match="unknown keys `eval.a`, `eval.log_steps`; allowed keys "
                                         "in `eval`: eval_steps, "):
        TrainingArguments(eval={"log_steps": 1, "a": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`logging` must be LoggingArguments\(\.\.\.\) or a "
                                         r"mapping of its fields, but is 'x'\."):
        TrainingArguments(logging="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`eval` must be EvalArguments\(\.\.\.\) or a mapping"):
        TrainingArguments(eval=LoggingArguments())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("save_steps", 0, "`save_steps` must be an int >= 1 or None, but is 0."),
        ("max_to_keep", 0, "`max_to_keep` must be an int >= 1, but is 0."),
        ("keep_best_mode", "best", "`keep_best_mode` must be one of 'min', 'max', but is 'best'."),
        ("reshard_data_position", "x", "`reshard_data_position` must be one of 'exact', 'error', "
                                       "'restart_window', 'next_window', but is 'x'."),
        ("params_not_save", "t_user", "`params_not_save` must be a list of name patterns"),
        ("save_filter_fn", 3, "`save_filter_fn` must be a callable name -> bool, but is 3."),
        ("model_bank", [3], "`model_bank` entries must be dicts, but one is 3."),
        ("keep_every_n_hours", 0, "`keep_every_n_hours` must be a number > 0 or None, but is 0."),
        ("eval_steps", 0, "`eval_steps` must be an int >= 1 or None, but is 0."),
        ("eval_every_n_rows", -1, "`eval_every_n_rows` must be an int >= 1 or None, but is -1."),
        ("log_steps", 2.5, "`log_steps` must be an int >= 1 or None, but is 2.5."),
        ("logging_dir", "s3://b/logs", "`logging_dir` must be a local directory"),
    ],
)
def test_a_section_names_the_invalid_field_as_before(field: str, value: object, message: str) -> None:
    section = FLAT_ALIASES[field]
    for kwargs in ({field: value}, {section: {field: value}}):
        with pytest.raises(ValueError) as err:
            TrainingArguments(**kwargs)  # type: ignore[arg-type]
        assert message in str(err.value)
    with pytest.raises(ValueError) as err:
        SECTIONS[section](**{field: value})  # type: ignore[arg-type]
    assert message in str(err.value)


def test_cross_section_checks_stay_in_training_arguments() -> None:
    with pytest.raises(ValueError, match=r"`eval_every_n_rows` evaluates between two steps, which "
                                         r"`pipeline` 'sparse_dist' cannot"):
        TrainingArguments(eval={"eval_every_n_rows": 10}, pipeline="sparse_dist")  # type: ignore[arg-type]
    TrainingArguments(eval_every_n_windows=1, pipeline="sparse_dist")
    EvalArguments(eval_every_n_steps=1)  # fine on its own: the pipeline is not its concern
    with pytest.raises(ValueError, match="the eval period is given 2 ways"):
        EvalArguments(eval_every_n_steps=1, eval_every_n_epochs=1)


def test_to_jsonable_is_flat() -> None:
    args = TrainingArguments(output_dir="/tmp/o", save_steps=3, save_filter_fn=lambda k: True,
                             model_bank=[ModelBankSource(path="/tmp/b")],
                             eval={"eval_every_n_epochs": 2})  # type: ignore[arg-type]
    out = args.to_jsonable()
    json.dumps(out)
    own = [f.name for f in dataclasses.fields(TrainingArguments) if f.name not in SECTIONS]
    assert set(out) == set(own) | set(FLAT_ALIASES)
    assert not set(out) & set(SECTIONS)
    assert out["save_steps"] == 3 and out["eval_every_n_epochs"] == 2 and out["log_steps"] == 100
    assert out["output_dir"] == "/tmp/o" and out["resume_from"] == "auto"
    assert isinstance(out["save_filter_fn"], str) and "lambda" in out["save_filter_fn"]
    assert out["model_bank"].startswith("[ModelBankSource(path='/tmp/b'")  # by its repr, as before
    # What args.json held before nesting, key for key, rebuilds the same arguments.
    flat = TrainingArguments().to_jsonable()
    assert TrainingArguments(**flat) == TrainingArguments()


def test_config_keys_and_the_signature_list_every_accepted_key() -> None:
    keys = TrainingArguments.config_keys()
    own = [f.name for f in dataclasses.fields(TrainingArguments)]
    assert keys == own + list(FLAT_ALIASES) and len(set(keys)) == len(keys)
    assert {"checkpoint", "eval", "logging", "save_steps", "log_steps", "eval_steps",
            "train_steps", "output_dir"} <= set(keys)
    # The constructor's signature (what the config loader reads) takes the same keys, each
    # optional, keyword-only.
    params = inspect.signature(TrainingArguments).parameters
    assert list(params) == keys
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in params.values())
    assert params["max_to_keep"].default == 5 and params["resume_from"].default == "auto"
    # Every key is accepted as written in YAML.
    for key in keys:
        value = {"checkpoint": {}, "eval": {}, "logging": {}}.get(key, getattr(TrainingArguments(), key))
        TrainingArguments(**{key: value})


def test_the_type_checking_declarations_match_the_sections() -> None:
    """The flat keys declared for mypy in ``TrainingArguments``' ``if TYPE_CHECKING:`` block (it
    does not run) name every section field once, with the section field's annotation."""
    import recsys_trainer.args as module

    tree = ast.parse(Path(module.__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainingArguments")
    block = next(n for n in cls.body if isinstance(n, ast.If)
                 and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING")
    declared = {s.target.id: ast.unparse(s.annotation) for s in block.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    expected = {f.name: ast.unparse(ast.parse(str(f.type), mode="eval").body)
                for cls_ in SECTIONS.values() for f in dataclasses.fields(cls_)}
    assert declared == expected
