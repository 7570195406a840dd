"""Shared by the tests of the command line's refusals (test_cli_errors, test_config, test_report,
test_data, test_rundir, test_settings, test_ouro_checkpoints): in-process `loopscale` calls and
the one-line error every refusal must be. A helper module, not a test file."""
from loopscale import cli


def run_cli(capsys, *argv) -> tuple[int, str]:
    """(exit code, stderr) of one in-process `loopscale` call."""
    rc = cli.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def one_line_error(rc: int, err: str, *words: str) -> None:
    assert rc == 2, err
    lines = [l for l in err.splitlines() if "loopscale: error" in l]
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])


def refused_in_one_line(capsys, argv, needle: str) -> str:
    """Run `loopscale argv`: exit code 2 and one stderr line holding `needle`; that line."""
    capsys.readouterr()
    assert cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    return err[0]
