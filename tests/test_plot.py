"""`jaxdist plot`: one PNG of loss, throughput (and accuracy) for one or several runs; a bad run dir is one line,
exit 2."""

import json

import pytest
from matplotlib.image import imread

from jaxdist import cli


def write_run(run_dir, steps: int, scale: float) -> None:
    """A metrics.jsonl as `train` writes it, with an eval every 5 steps, a null and a missing key."""
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "loss": scale * 5.0 / step, "tokens_per_sec": 1000.0 + 10 * step}
        if step % 5 == 0:
            record["eval_loss"] = scale * 5.5 / step
        lines.append(record)
    lines[2]["tokens_per_sec"] = None
    del lines[3]["loss"]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 2')


def test_plot_draws_one_or_several_runs(tmp_path, capfd, monkeypatch):
    write_run(tmp_path / "a", 20, 1.0)
    write_run(tmp_path / "b", 12, 1.3)
    monkeypatch.chdir(tmp_path)

    assert cli.main(["plot", "a", "b"]) == 0
    assert capfd.readouterr().out.strip() == "wrote plot.png"
    assert cli.main(["plot", str(tmp_path / "a")]) == 0
    assert capfd.readouterr().out.strip() == f"wrote {tmp_path / 'a' / 'plot.png'}"
    assert cli.main(["plot", "a", "--out", "figures/a.png"]) == 0
    for png in ("plot.png", "a/plot.png", "figures/a.png"):
        image = imread(tmp_path / png)
        assert image.shape[0] >= 400 and image.shape[1] >= 600 and image.shape[2] in (3, 4)
        assert image.std() > 0.05  # lines drawn, not a blank canvas


def test_run_dir_without_metrics_is_one_line_and_exit_2(tmp_path, capfd):
    write_run(tmp_path / "a", 5, 1.0)
    (tmp_path / "empty").mkdir()
    assert cli.main(["plot", str(tmp_path / "a"), str(tmp_path / "empty")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"jaxdist: error: plot: {tmp_path / 'empty'} has no metrics.jsonl; pass a run_dir written by `jaxdist train`"]
    assert not (tmp_path / "a" / "plot.png").exists() and not (tmp_path / "plot.png").exists()


def one_line_error(capfd) -> str:
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxdist: error: plot: "), err
    return err


@pytest.mark.parametrize("case", ["under_a_file", "unknown_format", "no_suffix", "a_directory"])
def test_an_out_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, capfd, case):
    write_run(tmp_path / "a", 5, 1.0)
    (tmp_path / "a_file").write_text("")
    out, message = {
        "under_a_file": (tmp_path / "a_file" / "x.png", f"cannot be written: {tmp_path / 'a_file'} is a file, not a directory"),
        "unknown_format": (tmp_path / "x.txt", "must end in a format matplotlib writes: "),
        "no_suffix": (tmp_path / "x", "must end in a format matplotlib writes: "),
        "a_directory": (tmp_path / "a", "is a directory; name the file to write"),
    }[case]
    assert cli.main(["plot", str(tmp_path / "a"), "--out", str(out)]) == 2
    err = one_line_error(capfd)
    assert f"--out={out} " in err and message in err, err
    if "format" in message:
        assert ".png, " in err and ".pdf, " in err and ".svg" in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a", "a_file"]
    assert sorted(path.name for path in (tmp_path / "a").iterdir()) == ["metrics.jsonl"]


def test_another_format_is_written_by_its_suffix(tmp_path, capfd):
    write_run(tmp_path / "a", 5, 1.0)
    assert cli.main(["plot", str(tmp_path / "a"), "--out", str(tmp_path / "a.pdf")]) == 0
    assert capfd.readouterr().out.strip() == f"wrote {tmp_path / 'a.pdf'}"
    assert (tmp_path / "a.pdf").read_bytes().startswith(b"%PDF")


def test_metrics_without_values_or_not_json_are_one_line_and_exit_2(tmp_path, capfd):
    (tmp_path / "nulls").mkdir()
    (tmp_path / "nulls" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": step, "loss": None, "tokens_per_sec": None}) + "\n" for step in (1, 2)))
    assert cli.main(["plot", str(tmp_path / "nulls")]) == 2
    assert "logged no value of loss, eval_loss, tokens_per_sec" in one_line_error(capfd)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "metrics.jsonl").write_text("\nstep 1 loss 2.0\n[1, 2]\n")
    assert cli.main(["plot", str(tmp_path / "text")]) == 2
    assert f"{tmp_path / 'text' / 'metrics.jsonl'} is not valid metrics JSON (line 2 " in one_line_error(capfd)
    (tmp_path / "cut").mkdir()  # killed while writing its first line: no steps yet, nothing invalid
    (tmp_path / "cut" / "metrics.jsonl").write_text('{"step": 1, "lo')
    assert cli.main(["plot", str(tmp_path / "cut")]) == 2
    assert "has no logged steps yet" in one_line_error(capfd)
    assert not list(tmp_path.rglob("*.png"))


def test_legend_names_runs_briefly_and_tokens_per_sec_starts_at_zero(tmp_path):
    from jaxdist.commands import plot

    assert plot.labels(["/tmp/x/run"]) == {"/tmp/x/run": ""}
    assert plot.labels(["runs/a", "other/b"]) == {"runs/a": "a ", "other/b": "b "}
    assert plot.labels(["x/run", "y/run"]) == {"x/run": "x/run ", "y/run": "y/run "}
    write_run(tmp_path / "a", 20, 1.0)
    loss, throughput = plot.figure({"a": plot.read_metrics(tmp_path / "a")}).axes
    assert [line.get_label() for line in loss.get_lines()] == ["loss", "eval_loss"]
    assert throughput.get_ylim()[0] == 0 and throughput.get_ylim()[1] >= 1200  # 1000 + 10 x step, up to 1200


def test_a_classifiers_plot_shows_examples_per_second_and_accuracy(tmp_path):
    from jaxdist.commands import plot

    (tmp_path / "c").mkdir()
    records = [{"step": step, "loss": 2.0 / step, "accuracy": 1 - 1 / (step + 1), "examples_per_sec": 500.0}
               for step in range(1, 6)]
    records[-1].update(eval_loss=0.3, eval_accuracy=0.9)
    (tmp_path / "c" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_run(tmp_path / "gpt", 5, 1.0)
    assert [title for title, _ in plot.panels({"gpt": plot.read_metrics(tmp_path / "gpt")})] == ["loss", "throughput"]
    runs = {"c": plot.read_metrics(tmp_path / "c")}
    assert [title for title, _ in plot.panels(runs)] == ["loss", "throughput", "accuracy"]
    loss, throughput, accuracy = plot.figure(runs).axes
    assert [line.get_label() for line in accuracy.get_lines()] == ["accuracy", "eval_accuracy"]
    assert [line.get_label() for line in throughput.get_lines()] == ["examples_per_sec"]
    assert imread(plot.plot([str(tmp_path / "c")])).shape[0] >= 800  # three panels
