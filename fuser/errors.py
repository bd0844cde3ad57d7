"""The one error a rule author sees."""

from __future__ import annotations


class RuleError(ValueError):
    """A mistake in a rule, located at its line and column.

    ``str(err)`` reads ``rule 'adamw', line 2, column 9: unknown name 'bta1'`` followed by
    the offending source line and a caret under the column, so a notebook cell shows
    exactly what to fix.
    """

    def __init__(
        self,
        message: str,
        *,
        line: int | None = None,
        col: int | None = None,
        source_line: str | None = None,
        rule: str | None = None,
    ):
        self.message = message
        self.line = line
        self.col = col
        self.source_line = source_line
        self.rule = rule
        super().__init__(self._format())

    def _format(self) -> str:
        where = []
        if self.rule:
            where.append(f"rule {self.rule!r}")
        if self.line is not None:
            where.append(f"line {self.line}")
        if self.col is not None:
            where.append(f"column {self.col}")
        head = (", ".join(where) + ": " if where else "") + self.message
        if self.source_line is None:
            return head
        caret = " " * max((self.col or 1) - 1, 0) + "^"
        return f"{head}\n    {self.source_line}\n    {caret}"

    def with_rule(self, name: str) -> RuleError:
        return RuleError(self.message, line=self.line, col=self.col, source_line=self.source_line, rule=name)

    def _render_traceback_(self) -> list[str]:
        # IPython shows these lines instead of a traceback through fuser's parser: the
        # message already names the rule, line and column, with a caret under the column.
        return f"RuleError: {self}".splitlines()
