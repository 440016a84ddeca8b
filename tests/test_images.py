"""Dockerfile subset: parsing errors name the line; layers build, cache by content and stack over the base."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run, spec
from furlong.sandbox import dockerfile as df
from furlong.sandbox.images import ImageBuildError


def _dockerfile(tmp_path: Path, text: str, files: dict[str, str] | None = None) -> Path:
    env = tmp_path / "environment"
    env.mkdir(parents=True, exist_ok=True)
    for name, content in (files or {}).items():
        (env / name).parent.mkdir(parents=True, exist_ok=True)
        (env / name).write_text(content)
    (env / "Dockerfile").write_text(text)
    return env / "Dockerfile"


@pytest.mark.parametrize("text, line, words", [
    ("FROM debian:bookworm\nEXPOSE 80\n", 2, "unsupported instruction EXPOSE"),
    ("# comment\n\nFROM ubuntu:22.04\n", 3, "unknown base 'ubuntu:22.04'"),
    ("RUN echo hi\n", 1, "first instruction must be FROM"),
    ("FROM debian:bookworm\nWORKDIR app\n", 2, "absolute"),
    ("FROM debian:bookworm\nCOPY --from=build /a /b\n", 2, "COPY flags"),
    ("FROM debian:bookworm\nRUN echo a \\\n  && echo b\nFROM debian:bookworm\n", 4, "multi-stage"),
    ("FROM debian:bookworm\nENV =x\n", 2, "KEY=VALUE"),
])
def test_unsupported_dockerfiles_name_the_line(tmp_path: Path, text: str, line: int, words: str):
    path = _dockerfile(tmp_path, text)
    with pytest.raises(df.DockerfileError) as err:
        df.parse(path)
    assert err.value.line == line and words in str(err.value) and str(path) in str(err.value)


def test_parse_accepts_the_subset_with_continuations_and_exec_form(tmp_path: Path):
    steps = df.parse(_dockerfile(tmp_path, (
        "FROM python:3.11-slim-bookworm\n# set up\nRUN echo a \\\n    && echo b\n"
        'RUN ["echo", "two words"]\nENV A=1 B="x y"\nENV LEGACY some value\nWORKDIR /app\nCOPY a.txt /app/\n')))
    assert [s.op for s in steps] == ["FROM", "RUN", "RUN", "ENV", "ENV", "WORKDIR", "COPY"]
    assert steps[1].args == "echo a && echo b" and steps[1].line == 3
    assert df.run_command(steps[2]) == "echo 'two words'"
    assert df.env_pairs(Path("x"), steps[3]) == [("A", "1"), ("B", "x y")]
    assert df.env_pairs(Path("x"), steps[4]) == [("LEGACY", "some value")]


def test_layer_builds_caches_and_stacks_over_the_base(store, backend, tmp_path: Path):
    files = {"data/a.txt": "alpha\n", "tool.sh": "echo tool\n"}
    path = _dockerfile(tmp_path, (
        "FROM debian:bookworm\nWORKDIR /app\nENV GREETING=hello MODE=\"x y\"\nCOPY data /app/data\n"
        "COPY tool.sh /usr/local/bin/tool\nRUN chmod +x /usr/local/bin/tool && rm /usr/bin/git "
        "&& echo built > /app/built.txt\n"), files)

    async def go():
        image = await store.image(path, backend)
        assert image.workdir == "/app" and dict(image.env) == {"GREETING": "hello", "MODE": "x y"}
        box = await backend.create(spec(image))
        try:
            r = await box.exec('pwd; cat data/a.txt built.txt; tool; echo "$GREETING $MODE"; which git || echo no-git')
            assert r.stdout == "/app\nalpha\nbuilt\ntool\nhello x y\nno-git\n", r
        finally:
            await box.close()
        again = await store.image(path, backend)
        assert again == image
        return image

    image = run(go())
    assert image.layers[1:] == store.base().layers
    # the layer's identity covers the content COPY brings in, not just the file names
    (tmp_path / "environment" / "data" / "a.txt").write_text("changed\n")
    steps = df.parse(path)
    assert store.layer_key(path, steps) != image.key


def test_failing_run_step_is_an_error_naming_the_line(store, backend, tmp_path: Path):
    path = _dockerfile(tmp_path, "FROM debian:bookworm\nRUN echo fine\nRUN echo doomed >&2; exit 7\n")
    leftovers = set(store.root.glob("layer-*.tmp*"))

    async def go():
        with pytest.raises(ImageBuildError) as err:
            await store.image(path, backend)
        assert f"{path}:3" in str(err.value) and "exited 7" in str(err.value) and "doomed" in str(err.value)

    run(go())
    assert set(store.root.glob("layer-*.tmp*")) == leftovers, "a failed build left its temp directory"


def test_copy_outside_the_context_is_refused(store, backend, tmp_path: Path):
    (tmp_path / "secret.txt").write_text("s")
    path = _dockerfile(tmp_path, "FROM debian:bookworm\nCOPY ../secret.txt /app/\n")

    async def go():
        with pytest.raises(df.DockerfileError, match="outside the build context"):
            await store.image(path, backend)

    run(go())
