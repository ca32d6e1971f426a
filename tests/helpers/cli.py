"""A command line's refusal as a test checks it: exit status 2, one line on stderr naming the
problem, no traceback."""

from olmax.cli import main


def refused_in_one_line(capsys, argv: list[str], needle: str) -> None:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err, err
