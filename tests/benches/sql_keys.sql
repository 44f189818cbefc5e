-- The cost of one key computed in SQL by lockkit's functions
-- (lockkit/sql/lockkit_keys.sql), against PostgreSQL's hashtext, over
-- 100,000 rows each; BENCHMARKS.md has the figures. Run it with the
-- functions installed:
--   psql -X -d "$DATABASE_URL" -f lockkit/sql/lockkit_keys.sql -f tests/benches/sql_keys.sql
\timing on
-- The rows alone.
SELECT count(g) FROM generate_series(1, 100000) g;
-- hashtext of a short text.
SELECT count(hashtext('Order:' || g)) FROM generate_series(1, 100000) g;
-- One encoder: lockkit.int.
SELECT count(lockkit.int(g::int8)) FROM generate_series(1, 100000) g;
-- A 1-field type: struct Order { id: i64 }, its BigInt key.
SELECT count(lockkit.key('Order', lockkit.int(g::int8))) FROM generate_series(1, 100000) g;
-- The same type's Pair object (one SipHash instead of two).
SELECT count(lockkit.pair_object('Order', lockkit.int(g::int8))) FROM generate_series(1, 100000) g;
-- A 5-field type: struct Shipment { tenant: String, order: i64, line: i32,
-- express: bool, region: Option<String> }, its BigInt key.
SELECT count(lockkit.key('Shipment', lockkit.str('acme'), lockkit.int(g::int8), lockkit.int(g % 100),
    lockkit.bool(g % 2 = 0), lockkit.option(lockkit.str('eu')))) FROM generate_series(1, 100000) g;
