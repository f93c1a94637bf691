"""The intermediate representation: compute actions and their text form, the Schedule (per
rank, an ordered list of actions plus placement), the lowered Program and its op table,
sharding policies and DP units. Everything above builds on these types."""
