"""How the tests read the `miles-mis` command's answers, in-process."""

from miles_mis import cli


def analyze_cli(capsys, *argv):
    """`miles-mis analyze ARGV...` in-process: (exit status, stdout, stderr)."""
    code = cli.main(["analyze", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err):
    """The CLI's answer to bad input: exit 1 and exactly one stderr line 'error: ...'; returns the message."""
    assert code == 1, err
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    return err[len("error: "):-1]
