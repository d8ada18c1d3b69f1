try:
    from tandem.engine.rows import RowsRunner
    RowsRunner._record_grown = lambda self, rows: False
except Exception as err:  # noqa
    print("patch failed", err)
