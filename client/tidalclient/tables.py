"""Tables that are never cut: `Fitted` draws a table whole where it fits the width it is given,
else with its headers folded, else in groups of columns or one record per row, so that a value
is never truncated (`…`) however narrow the terminal or pipe. Every table of the commands
(status, top, demo, simulate, replay) is one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

_WIDE = 1 << 20  # a width no table reaches: measures what a table needs, not what it is given


class Fitted:
    """A table that is never cut: each column as wide as its widest value, drawn in the first
    of these layouts that fits the width it is given:

    1. whole;
    2. with headers folded onto lines of their own (at spaces and after hyphens, no
       narrower than the column's values);
    3. in groups of columns stacked one under the other, each led by the first column (the
       row's name), headers folded only where whole ones would take more groups;
    4. one block per row: the row's name, then `header  value` lines.

        ┏━━━━━━━━━━━┳━━━━━━━━━━━┓                 autoswap-doa
        ┃ autoswap- ┃ autoswap- ┃    or, at 30      feasible  yes
        ┃       doa ┃       aoa ┃    columns:       overhead  3935.5%
        ┡━━━━━━━━━━━╇━━━━━━━━━━━┩
        │   3935.5% │   3337.6% │

    `left`: the columns aligned left (the others, numbers, right). `plain`: no box (top).
    """

    def __init__(
        self,
        headers: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        title: str | None = None,
        left: Collection[int] = (0,),
        plain: bool = False,
    ) -> None:
        if len(set(headers)) != len(headers):
            raise ValueError(f"two columns share a header: {list(headers)}")
        for row in rows:
            if len(row) != len(headers):
                raise ValueError(f"{len(row)} values for {len(headers)} columns: {list(row)}")
        self.headers = tuple(headers)
        self.rows = tuple(tuple(row) for row in rows)
        self.title, self.left, self.plain = title, frozenset(left), plain

    def _cells(self, j: int) -> int:
        """The width of column j's widest value."""
        return max((Text(row[j]).cell_len for row in self.rows), default=0)

    def _header(self, j: int, folded: bool) -> str:
        """Column j's header: whole, or folded to the column's width (at least its longest
        word): at spaces, where the pieces are joined by a space, and after hyphens."""
        header = self.headers[j]
        if not folded:
            return header
        pieces = re.findall(r"[^\s-]*-+|[^\s-]+", header)
        width = max([self._cells(j), *(Text(p).cell_len for p in pieces)])
        lines = [""]
        for piece in pieces:
            glue = "" if not lines[-1] or lines[-1].endswith("-") else " "
            if lines[-1] and Text(lines[-1] + glue + piece).cell_len > width:
                lines.append(piece)
            else:
                lines[-1] += glue + piece
        return "\n".join(lines)

    def table(
        self, folded: bool = False, columns: Sequence[int] | None = None, titled: bool = True
    ) -> Table:
        """The table with its headers whole, or `folded`, of all columns or of `columns`; no
        value is ever wrapped."""
        title = self.title if titled else None
        table = Table(title=title, box=None, pad_edge=False) if self.plain else Table(title=title)
        chosen = range(len(self.headers)) if columns is None else columns
        for j in chosen:
            header = self._header(j, folded)
            widest = max([self._cells(j), *(Text(line).cell_len for line in header.split("\n"))])
            table.add_column(
                Text(header),
                justify="left" if j in self.left else "right",
                no_wrap=True,
                min_width=widest,
            )
        for row in self.rows:
            table.add_row(*(Text(row[j]) for j in chosen))
        return table

    def records(self, width: int) -> Group:
        """Layout 4, one block per row: `header  value` lines, aligned where they fit `width`,
        else each value on a line of its own under its header."""
        pad = max((Text(h).cell_len for h in self.headers[1:]), default=0)
        widest = max((Text(c).cell_len for row in self.rows for c in row[1:]), default=0)
        aligned = 2 + pad + 2 + widest <= width
        parts: list[RenderableType] = []
        if self.title:
            parts.append(Text(self.title, style="italic", overflow="fold"))
        for k, row in enumerate(self.rows):
            if k or self.title:
                parts.append(Text(""))
            parts.append(Text(row[0], style="bold", overflow="fold"))
            for header, cell in zip(self.headers[1:], row[1:], strict=True):
                if aligned:
                    parts.append(Text(f"  {header:<{pad}}  {cell}"))
                else:
                    parts.append(Text(f"  {header}", overflow="fold"))
                    parts.append(Text(f"    {cell}", overflow="fold"))
        return Group(*parts)

    def _groups(self, fits: Callable[[Table], bool], folded: bool) -> list[list[int]] | None:
        """Layout 3: the columns after the first in groups, as many to a group as `fits`,
        headers whole or `folded`; None when even one column beside the first does not."""
        groups: list[list[int]] = []
        for j in range(1, len(self.headers)):
            if groups and fits(self.table(folded, [0, *groups[-1], j], not groups[:-1])):
                groups[-1].append(j)
            elif fits(self.table(folded, [0, j], not groups)):
                groups.append([j])
            else:
                return None
        return groups

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        wide = options.update_width(_WIDE)

        def fits(table: Table) -> bool:
            return Measurement.get(console, wide, table).minimum <= options.max_width

        for table in (self.table(folded=False), self.table(folded=True)):
            if fits(table):
                yield table
                return
        if len(self.headers) < 3:
            yield self.records(options.max_width)
            return
        whole, folded = self._groups(fits, False), self._groups(fits, True)
        if folded is None:
            yield self.records(options.max_width)
            return
        # Whole headers where they take no more groups than folded ones.
        fold = whole is None or len(whole) > len(folded)
        parts: list[RenderableType] = []
        for k, group in enumerate(folded if fold or whole is None else whole):
            if k:
                parts.append(Text(""))
            parts.append(self.table(fold, [0, *group], titled=not k))
        yield Group(*parts)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        whole = Measurement.get(console, options.update_width(_WIDE), self.table())
        return Measurement(min(whole.maximum, 1), whole.maximum).with_maximum(options.max_width)
