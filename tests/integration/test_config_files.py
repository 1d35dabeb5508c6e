"""`--config FILE` (YAML or JSON) for train, translate and serve: the file's settings are the
command's defaults, the command line overrides them, `--print-config` writes what the command
would use as a file `--config` takes back, and a mistyped key is one line naming it."""

import json

from conftest import one_error_line


def test_a_file_sets_train_and_the_command_line_overrides_it(tmp_path, nmt):
    (tmp_path / "run.yaml").write_text(
        "# a run's settings\nsize: tiny\nmax-tokens: 2048\nwarmup: 100\nschedule: cosine\n"
        "max_steps: 500\noptimizer: adamw\nweight_decay: 0.01\ncompile: true\n"
    )
    run = tmp_path / "run"
    printed = nmt(
        "train", "--run-dir", run, "--config", tmp_path / "run.yaml", "--warmup", "50", "--print-config"
    )
    assert printed.code == 0, printed.err
    settings = json.loads(printed.out)
    assert settings["size"] == "tiny" and settings["max_tokens"] == 2048 and settings["compile"] is True
    assert settings["schedule"] == "cosine" and settings["weight_decay"] == 0.01
    assert settings["warmup"] == 50  # the command line wins
    assert settings["beta2"] == 0.98 and settings["run_dir"] == str(run)  # the rest: defaults
    (tmp_path / "printed.json").write_text(printed.out)  # what it printed, read back: the same
    again = nmt("train", "--config", tmp_path / "printed.json", "--print-config")
    assert json.loads(again.out) == settings
    assert not run.exists()  # printing makes nothing


def test_translate_and_serve_take_a_file_too(trained, tmp_path, nmt):
    (tmp_path / "decode.yaml").write_text(f"run_dir: {trained}\nbeam: 1\nmax_len: 5\nthreads: 1\n")
    stdin = b"A man is riding a bike.\nTwo dogs play in the snow.\n"
    from_file = nmt("translate", "--config", tmp_path / "decode.yaml", stdin=stdin)
    flags = nmt(
        "translate", "--run-dir", trained, "--beam", "1", "--max-len", "5", "--threads", "1", stdin=stdin
    )
    assert from_file.code == 0 and from_file.out == flags.out and from_file.out.count("\n") == 2
    (tmp_path / "serve.json").write_text(json.dumps({"model": str(trained), "port": 9999, "beam": 2}))
    printed = json.loads(
        nmt("serve", "--config", tmp_path / "serve.json", "--print-config", "--beam", "3").out
    )
    assert (printed["model"], printed["port"], printed["beam"]) == (str(trained), 9999, 3)
    assert "api_key" not in printed  # a secret is never printed


def test_a_mistyped_key_or_a_broken_file_is_one_line_naming_where(tmp_path, nmt):
    (tmp_path / "typo.yaml").write_text("size: tiny\n\nmax_tokns: 5\n")
    line = one_error_line(nmt("train", "--config", tmp_path / "typo.yaml"))
    assert "typo.yaml, line 3: unknown setting 'max_tokns': did you mean max_tokens?" in line
    (tmp_path / "broken.yaml").write_text("size: tiny\nwarmup: [1, 2\n")
    assert "broken.yaml, line 3 is not valid YAML or JSON" in one_error_line(
        nmt("train", "--config", tmp_path / "broken.yaml")
    )
    (tmp_path / "list.yaml").write_text("- size\n")
    assert "must hold a mapping" in one_error_line(nmt("translate", "--config", tmp_path / "list.yaml"))
    assert "No such file" in one_error_line(nmt("serve", "--config", tmp_path / "none.yaml"))
