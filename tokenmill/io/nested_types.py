"""Rebuilding a nested Arrow type with its children's types changed."""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa


def with_child_types(
    dtype: pa.DataType, child: Callable[[pa.DataType], pa.DataType]
) -> pa.DataType:
    """``dtype`` with ``child`` applied to the type of each of its direct children (a struct's
    fields, a map's key and item, a list's values; a fixed-size list becomes a list of that
    size); ``dtype`` itself when it has none. ``child`` recursing through this goes down the
    whole type."""

    def field(f: pa.Field) -> pa.Field:
        return f.with_type(child(f.type))

    if pa.types.is_struct(dtype):
        return pa.struct([field(dtype.field(i)) for i in range(dtype.num_fields)])
    if pa.types.is_map(dtype):
        return pa.map_(field(dtype.key_field), field(dtype.item_field))
    if pa.types.is_list(dtype):
        return pa.list_(field(dtype.value_field))
    if pa.types.is_large_list(dtype):
        return pa.large_list(field(dtype.value_field))
    if pa.types.is_fixed_size_list(dtype):
        return pa.list_(field(dtype.value_field), dtype.list_size)
    return dtype
