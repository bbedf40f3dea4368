"""The generated reference pages stay true to the code.

Every field of every policy model carries a description and an example (put there by
kvpolicy/policies/field_docs.py), each example is a value its field accepts, and the
committed pages docs/reference/policy-file.md and cli.md are what docs/gen_reference.py
writes now.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from typing import Annotated

import pytest
import yaml
from pydantic import BaseModel, TypeAdapter

from kvpolicy.policies import calibration, field_docs, load_spec, schema, spec

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = ".venv/bin/python docs/gen_reference.py"


def _generator():
    loaded = importlib.util.spec_from_file_location("gen_reference",
                                                    ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


gen = _generator()

MODELS = sorted(
    (obj for module in (calibration, schema, spec) for obj in vars(module).values()
     if inspect.isclass(obj) and issubclass(obj, BaseModel)
     and obj.__module__ == module.__name__),
    key=lambda m: m.__name__,
)
FIELDS = [(m, name) for m in MODELS for name in m.model_fields]


def test_every_policy_model_has_a_section():
    documented = {section[0] for section in gen.SECTIONS}
    missing = [m.__name__ for m in MODELS if m not in documented]
    assert not missing, (f"no section of docs/reference/policy-file.md for {missing}: add it to "
                         "SECTIONS in docs/gen_reference.py")


def test_every_field_has_a_reference_entry():
    missing = [f"{m.__name__}.{name}" for m, name in FIELDS
               if not m.model_fields[name].description or not m.model_fields[name].examples]
    assert not missing, (
        f"fields without a description and an example: {', '.join(missing)}; add an entry "
        f"to FIELD_DOCS in kvpolicy/policies/field_docs.py, then run {REGENERATE}"
    )


def test_no_entry_for_a_field_that_does_not_exist():
    by_name = {m.__name__: m for m in MODELS}
    stale = [f"{model}.{name}" for model, docs in field_docs.FIELD_DOCS.items()
             for name in docs if model not in by_name or name not in by_name[model].model_fields]
    assert not stale, f"FIELD_DOCS entries for no field: {', '.join(stale)}"


def _example(model: type[BaseModel], name: str):
    examples = model.model_fields[name].examples
    if not examples:
        pytest.skip("no example (test_every_field_has_a_reference_entry names it)")
    return examples[0]


@pytest.mark.parametrize(("model", "name"), FIELDS, ids=[f"{m.__name__}.{n}" for m, n in FIELDS])
def test_example_is_a_value_the_field_accepts(model, name):
    info = model.model_fields[name]
    example = _example(model, name)
    tp = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    TypeAdapter(tp).validate_python(example)


@pytest.mark.parametrize("name", spec.Defaults.model_fields)
def test_defaults_example_is_a_valid_defaults(name):
    # A field that only means something beside another is validated with it.
    needs = {"budget_context": {"stored_bits": 3.0},
             "budget_pages": {"stored_bits": 3.0}}.get(name, {})
    spec.Defaults.model_validate({**needs, name: _example(spec.Defaults, name)})


@pytest.mark.parametrize("name", spec.OverrideRule.model_fields)
def test_rule_example_is_a_valid_rule(name):
    example = _example(spec.OverrideRule, name)
    spec.OverrideRule.model_validate({"layers": "*", "tensor": "*", "sinks": 4, name: example})


@pytest.mark.parametrize("text", gen.EXAMPLES, ids=["full", "budget"])
def test_page_examples_load_as_policy_files(text):
    load_spec(yaml.safe_load(text))


@pytest.mark.parametrize("path", sorted(gen.PAGES))
def test_committed_page_is_what_the_generator_writes(path):
    page = ROOT / path
    assert page.is_file(), f"{path} is missing: run {REGENERATE}"
    assert page.read_text(encoding="utf-8") == gen.PAGES[path](), (
        f"{path} is stale (the schema or the CLI changed since it was generated): run "
        f"{REGENERATE} and commit the page"
    )


def test_a_field_without_an_entry_is_caught():
    """The check above can fail: a model with an undocumented field has no description."""

    @field_docs.documented
    class Probe(BaseModel):
        documented_nowhere: int = 0

    info = Probe.model_fields["documented_nowhere"]
    assert info.description is None and not info.examples
