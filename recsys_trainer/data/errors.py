"""``DataError``: bad input data, named by file, column, row group and row."""

from __future__ import annotations


class DataError(ValueError):
    """Bad input data. The message names the file / column / row group / row and the fix."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        column: str | None = None,
        row_group: int | None = None,
        row: int | None = None,
    ) -> None:
        self.file, self.column, self.row_group, self.row = file, column, row_group, row
        self.detail = message
        where = []
        if file is not None:
            where.append(f"file {file}")
        if row_group is not None:
            where.append(f"row group {row_group}")
        if row is not None:
            where.append(f"row {row}")
        if column is not None:
            where.append(f"column {column!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


class _RowError(DataError):
    """A problem at a row of the batch being decoded; the reader maps ``row`` to its source."""

