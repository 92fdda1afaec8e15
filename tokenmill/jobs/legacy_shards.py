"""Parquet shards committed before a job had one schema, brought to the schema on resume.

    manifest without output_schema ─► schema decided now ─► each committed shard:
        same schema                       kept
        same values in the schema's types rewritten (one atomic write; size recorded)
          (null -> double, int64 -> double exactly, columns reordered or missing)
        anything else                     kept as it is, counted for a warning

Earlier versions chose each shard's passthrough types from its own rows (``null`` in one,
``double`` in the next). A value is never changed by the rewrite: a column whose values do
not fit the new type exactly, and a string column that would become JSON text (an older
shard's strings may be JSON or not, which cannot be told apart), leave the shard as it was.
A crash between a rewrite and the manifest's save leaves a shard of another size than
recorded, which the next run recomputes (``drop_missing_shards``).
"""

from __future__ import annotations

from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.storage import OutputStore
from tokenmill.jobs.manifest import Manifest

__all__ = ["conform_legacy_shards"]


def conform_legacy_shards(store: OutputStore, manifest: Manifest, schema: OutputSchema) -> int:
    """Rewrite ``manifest``'s committed Parquet shards whose schema is not ``schema`` but whose
    values fit it exactly; save the manifest with their new sizes. Returns how many shards
    still have another schema (left as they were)."""
    rewritten = kept = 0
    for index, record in sorted(manifest.shards.items()):
        if record.data is None or not record.data.endswith(".parquet"):
            continue
        data = store.read_bytes(record.data)
        if data is None:  # verified a moment ago; gone since: the next run recomputes it
            continue
        table = pq.read_table(pa.BufferReader(data))
        if table.schema.equals(schema.schema, check_metadata=True):
            continue
        conformed = _conformed(table, schema)
        if conformed is None:
            kept += 1
            continue
        sink = pa.BufferOutputStream()
        pq.write_table(conformed, sink)
        new = sink.getvalue().to_pybytes()
        store.write_atomic(record.data, new)
        manifest.shards[index] = replace(record, data_bytes=len(new))
        rewritten += 1
    if rewritten:
        manifest.save(store)
    return kept


def _conformed(table: pa.Table, schema: OutputSchema) -> pa.Table | None:
    """``table`` in ``schema``'s columns and types, or None when a value would change."""
    if set(table.column_names) - set(schema.schema.names):
        return None
    passthrough = {f.name for f in schema.passthrough}
    ids = [str(i) for i in table.column("id").to_pylist()]
    columns = []
    for f in schema.schema:
        if f.name not in table.column_names:
            columns.append(pa.nulls(table.num_rows, f.type))
            continue
        column = table.column(f.name)
        if column.null_count == len(column):
            columns.append(pa.nulls(table.num_rows, f.type))
        elif f.name in passthrough and schema.is_json_text(f.name):
            return None  # an older shard's strings may be JSON or not
        elif column.type == f.type:
            columns.append(column.combine_chunks())
        elif f.name in passthrough:
            try:  # only if every value reads back the same in the new type
                columns.append(schema.column(f.name, column.to_pylist(), ids))
            except ValueError:
                return None
        else:
            return None
    return pa.Table.from_arrays(columns, schema=schema.schema)
