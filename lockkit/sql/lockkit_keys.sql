-- lockkit keys from SQL: the key format of docs/KEYS.md (version 1) as plain
-- SQL and PL/pgSQL functions in the schema `lockkit`.
--
-- Supported: PostgreSQL 12, 13, 14, 15, 16 and 17. No C, no extension, no
-- superuser: it runs on managed PostgreSQL. The role that installs it needs
-- CREATE on the database (for the schema) or an existing schema `lockkit`
-- that it owns.
--
-- Installing is idempotent: run it again (the same version) and nothing
-- changes. Run it in one transaction to install all or nothing:
--     psql --single-transaction -f lockkit_keys.sql
-- (lockkit's `lockkit::sql::install` and `lockkit sql install` send it as one
-- statement batch, which PostgreSQL runs in one transaction.)
--
-- Every process that locks an entity must compute the same key for it. These
-- functions compute the keys the Rust derive `#[derive(AdvisoryKey)]`
-- computes, so SQL (a migration, a psql session, a cron job, a service in
-- another language) takes the same lock as the Rust service:
--
--     -- struct Order { id: i64 }
--     SELECT pg_advisory_xact_lock(lockkit.key('Order', lockkit.int(42)));
--     -- struct Tenanted<'a> { tenant: &'a str, id: u64 }
--     SELECT pg_advisory_xact_lock(lockkit.key('Tenanted', lockkit.str('acme'), lockkit.int(1001)));
--     -- #[advisory_key(pair)] struct Order { id: i64 }
--     SELECT pg_advisory_xact_lock(lockkit.pair_class('Order'), lockkit.pair_object('Order', lockkit.int(42)));
--     -- #[advisory_key(stripes = 1024)] struct Event { business_key: String }
--     SELECT pg_advisory_xact_lock(lockkit.striped_key('Event', 1024, lockkit.str('a1b2c3d4')));
--
-- `lockkit key --sql NAMESPACE VALUE...` prints the expression for a key.
--
-- The pieces:
--   part encoders, each returning the canonical encoding (bytea) of one value:
--     lockkit.int(smallint | integer | bigint | numeric)  every integer, by value
--                                      (numeric: up to u128, as `i128`/`u128`)
--     lockkit.bool(boolean)
--     lockkit.char(text)               one character (in a SQL_ASCII database,
--                                      its bytes as UTF-8); lockkit.char(integer)
--                                      by its Unicode scalar value
--     lockkit.str(text)                a string (its UTF-8 bytes)
--     lockkit.uuid(uuid)
--     lockkit.none(), lockkit.some(part), lockkit.option(part or NULL)
--     lockkit.seq(part, ...), lockkit.seq()  a sequence (slice, Vec, array)
--     lockkit.tuple(part, ...)         a tuple or nested key type (concatenation,
--                                      the same as listing the parts, or `||`)
--     lockkit.variant(name, part, ...), lockkit.variant(name)  an enum variant
--   keys of a namespace and its parts (the fields in declaration order):
--     lockkit.key(ns, part, ...)               BigInt key (the derive's default)
--     lockkit.striped_key(ns, stripes, part, ...)   BigInt key, `stripes = N`
--     lockkit.pair_class(ns)                   the derived class of Pair keys
--     lockkit.pair_object(ns, part, ...)       object of the hashed Pair key
--     lockkit.striped_pair_object(ns, stripes, part, ...)
--   KEYS.md's own terms: lockkit.sip(bytes), lockkit.ns_hash(ns),
--   lockkit.tag(ns), lockkit.body(ns, parts), lockkit.u32le(n), lockkit.i64le(n);
--   lockkit.format_version(), the key format version (1);
--   and two helpers: lockkit.namespace_bytes(ns) (the checked namespace) and
--   lockkit.hashed_key(...) (the common body of the key functions).
--
-- Exact pairs (`pair = "exact"`) need no function: the key is
-- `(lockkit.pair_class(ns), value)`, or `(N, value)` with `class = N`. An
-- explicit class (`class = N`) is the first argument as it is:
-- `pg_advisory_xact_lock(N, lockkit.pair_object(ns, ...))`. Raw keys are the
-- values themselves, and `lockkit::HashText` keys are `hashtext(text)`.
--
-- The namespace tag names a type in pg_locks (BigInt keys, objsubid = 1):
--     SELECT * FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1
--        AND classid::int8 >> 16 = lockkit.tag('Order');
--
-- A key is never NULL: the key functions raise an error on a NULL namespace
-- or part (`pg_advisory_xact_lock(NULL)` would return without locking
-- anything). The encoders return NULL for NULL, so a NULL column reaches the
-- key function and fails there; use lockkit.option(...) for an `Option`.
--
-- A PostgreSQL text cannot hold U+0000: a string containing it cannot be
-- encoded here (the char U+0000 alone is lockkit.char(0)).
--
-- Every function is IMMUTABLE and PARALLEL SAFE (a pure function of its
-- arguments), pins its search_path, names lockkit's own functions by schema,
-- and builds no SQL from its arguments. Byte strings are written
-- decode('...', 'hex'), which the planner folds once, so that no function
-- depends on the caller's standard_conforming_strings.
--
-- An integer literal picks its lockkit.int by its type (int4, int8, or
-- numeric beyond); a quoted one needs a cast: lockkit.int('42'::int8).

-- Installs running at the same time, each in a transaction (instances of an
-- application that all install at startup), take turns: two concurrent
-- CREATE OR REPLACE of one function fail. The key is a lockkit key of its own
-- (`lockkit key --form bigint lockkit.sql s:install`). Outside a transaction
-- the lock is released at once and changes nothing.
SELECT pg_catalog.pg_advisory_xact_lock(1859504235373255752);

CREATE SCHEMA IF NOT EXISTS lockkit;

COMMENT ON SCHEMA lockkit IS
    'lockkit advisory-lock keys (docs/KEYS.md, key format version 1) computed in SQL';

-- The key format version these functions implement (docs/KEYS.md).
CREATE OR REPLACE FUNCTION lockkit.format_version() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 1 $$;

-- u32le(n): the 4 little-endian bytes of n, 0 <= n < 2^32.
CREATE OR REPLACE FUNCTION lockkit.u32le(n bigint) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF n < 0 OR n > 4294967295 THEN
        RAISE EXCEPTION 'lockkit: % is not a u32', n USING ERRCODE = 'numeric_value_out_of_range';
    END IF;
    RETURN substr(int8send(((n & 255) << 56) | (((n >> 8) & 255) << 48)
        | (((n >> 16) & 255) << 40) | (((n >> 24) & 255) << 32)), 1, 4);
END
$$;

-- i64le(n): the 8 little-endian bytes of n (two's complement).
CREATE OR REPLACE FUNCTION lockkit.i64le(n bigint) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- int8send is big-endian: send the byte-swapped value. Shifts of int8
    -- wrap (no overflow error); `& 255` drops the sign extension of `>>`.
    RETURN int8send(((n & 255) << 56) | (((n >> 8) & 255) << 48)
        | (((n >> 16) & 255) << 40) | (((n >> 24) & 255) << 32)
        | (((n >> 32) & 255) << 24) | (((n >> 40) & 255) << 16)
        | (((n >> 48) & 255) << 8) | ((n >> 56) & 255));
END
$$;

-- sip(bytes): SipHash-2-4, 64-bit result, keyed with the 16 ASCII bytes
-- `lockkit-keys-v1!` (k0 = u64le("lockkit-"), k1 = u64le("keys-v1!")), as
-- the bits of a bigint.
--
-- The 64-bit words are bigints. Addition modulo 2^64 is computed from the
-- 32-bit halves (bigint `+` raises on overflow; `<<` wraps), rotations from
-- shifts with the sign extension of `>>` masked off.
CREATE OR REPLACE FUNCTION lockkit.sip(data bytea) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    -- The initial state: k0 ^ "somepseu", k1 ^ "dorandom", k0 ^ "lygenera",
    -- k1 ^ "tedbytes".
    v0 bigint := 6781018122566502937;   -- 0x5e1b040e1b100a19
    v1 bigint := 4998437361380297222;   -- 0x455e044c1d1d0a06
    v2 bigint := 4687418240539172109;   -- 0x410d0e0e05061d0d
    v3 bigint := 6148559521947910168;   -- 0x5554124f0a0d0018
    len integer := octet_length(data);
    tail integer := len - len % 8;
    i integer := 0;
    m bigint;
    r integer;
BEGIN
    LOOP
        IF i < tail THEN
            m := get_byte(data, i)::bigint
                | (get_byte(data, i + 1)::bigint << 8)
                | (get_byte(data, i + 2)::bigint << 16)
                | (get_byte(data, i + 3)::bigint << 24)
                | (get_byte(data, i + 4)::bigint << 32)
                | (get_byte(data, i + 5)::bigint << 40)
                | (get_byte(data, i + 6)::bigint << 48)
                | (get_byte(data, i + 7)::bigint << 56);
        ELSE
            -- The last word: the remaining bytes, and the length's low byte
            -- on top.
            m := (len::bigint & 255) << 56;
            FOR r IN 0 .. len - tail - 1 LOOP
                m := m | (get_byte(data, tail + r)::bigint << (8 * r));
            END LOOP;
        END IF;
        v3 := v3 # m;
        FOR r IN 1 .. 2 LOOP
            v0 := ((((v0 >> 32) + (v1 >> 32) + (((v0 & 4294967295) + (v1 & 4294967295)) >> 32)) << 32)
                | (((v0 & 4294967295) + (v1 & 4294967295)) & 4294967295));
            v1 := ((v1 << 13) | ((v1 >> 51) & 8191)) # v0;
            v0 := (v0 << 32) | ((v0 >> 32) & 4294967295);
            v2 := ((((v2 >> 32) + (v3 >> 32) + (((v2 & 4294967295) + (v3 & 4294967295)) >> 32)) << 32)
                | (((v2 & 4294967295) + (v3 & 4294967295)) & 4294967295));
            v3 := ((v3 << 16) | ((v3 >> 48) & 65535)) # v2;
            v0 := ((((v0 >> 32) + (v3 >> 32) + (((v0 & 4294967295) + (v3 & 4294967295)) >> 32)) << 32)
                | (((v0 & 4294967295) + (v3 & 4294967295)) & 4294967295));
            v3 := ((v3 << 21) | ((v3 >> 43) & 2097151)) # v0;
            v2 := ((((v2 >> 32) + (v1 >> 32) + (((v2 & 4294967295) + (v1 & 4294967295)) >> 32)) << 32)
                | (((v2 & 4294967295) + (v1 & 4294967295)) & 4294967295));
            v1 := ((v1 << 17) | ((v1 >> 47) & 131071)) # v2;
            v2 := (v2 << 32) | ((v2 >> 32) & 4294967295);
        END LOOP;
        v0 := v0 # m;
        EXIT WHEN i >= tail;
        i := i + 8;
    END LOOP;
    v2 := v2 # 255;
    FOR r IN 1 .. 4 LOOP
        v0 := ((((v0 >> 32) + (v1 >> 32) + (((v0 & 4294967295) + (v1 & 4294967295)) >> 32)) << 32)
            | (((v0 & 4294967295) + (v1 & 4294967295)) & 4294967295));
        v1 := ((v1 << 13) | ((v1 >> 51) & 8191)) # v0;
        v0 := (v0 << 32) | ((v0 >> 32) & 4294967295);
        v2 := ((((v2 >> 32) + (v3 >> 32) + (((v2 & 4294967295) + (v3 & 4294967295)) >> 32)) << 32)
            | (((v2 & 4294967295) + (v3 & 4294967295)) & 4294967295));
        v3 := ((v3 << 16) | ((v3 >> 48) & 65535)) # v2;
        v0 := ((((v0 >> 32) + (v3 >> 32) + (((v0 & 4294967295) + (v3 & 4294967295)) >> 32)) << 32)
            | (((v0 & 4294967295) + (v3 & 4294967295)) & 4294967295));
        v3 := ((v3 << 21) | ((v3 >> 43) & 2097151)) # v0;
        v2 := ((((v2 >> 32) + (v1 >> 32) + (((v2 & 4294967295) + (v1 & 4294967295)) >> 32)) << 32)
            | (((v2 & 4294967295) + (v1 & 4294967295)) & 4294967295));
        v1 := ((v1 << 17) | ((v1 >> 47) & 131071)) # v2;
        v2 := (v2 << 32) | ((v2 >> 32) & 4294967295);
    END LOOP;
    RETURN v0 # v1 # v2 # v3;
END
$$;


-- The canonical encoding of KEYS.md: one function per part type, each
-- returning the bytes of one value (NULL for NULL, which the key functions
-- then refuse). Little-endian integers are written inline, as in
-- lockkit.i64le: a function call costs more than the expression.

-- An integer by value: `01 ++ i64le(value)`.
CREATE OR REPLACE FUNCTION lockkit.int(v bigint) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN decode('01', 'hex') || int8send(((v & 255) << 56) | (((v >> 8) & 255) << 48)
        | (((v >> 16) & 255) << 40) | (((v >> 24) & 255) << 32)
        | (((v >> 32) & 255) << 24) | (((v >> 40) & 255) << 16)
        | (((v >> 48) & 255) << 8) | ((v >> 56) & 255));
END
$$;

CREATE OR REPLACE FUNCTION lockkit.int(v integer) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n bigint := v;
BEGIN
    RETURN decode('01', 'hex') || int8send(((n & 255) << 56) | (((n >> 8) & 255) << 48)
        | (((n >> 16) & 255) << 40) | (((n >> 24) & 255) << 32)
        | (((n >> 32) & 255) << 24) | (((n >> 40) & 255) << 16)
        | (((n >> 48) & 255) << 8) | ((n >> 56) & 255));
END
$$;

CREATE OR REPLACE FUNCTION lockkit.int(v smallint) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n bigint := v;
BEGIN
    RETURN decode('01', 'hex') || int8send(((n & 255) << 56) | (((n >> 8) & 255) << 48)
        | (((n >> 16) & 255) << 40) | (((n >> 24) & 255) << 32)
        | (((n >> 32) & 255) << 24) | (((n >> 40) & 255) << 16)
        | (((n >> 48) & 255) << 8) | ((n >> 56) & 255));
END
$$;

-- An integer of any Rust width, up to u128, by value: `01 ++ i64le` when it
-- fits i64, `02 ++ i128le` when it fits i128, `03 ++ u128le` up to
-- u128::MAX. A fraction, NaN or anything out of range is an error.
CREATE OR REPLACE FUNCTION lockkit.int(v numeric) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    two64 CONSTANT numeric := 18446744073709551616;
    two127 CONSTANT numeric := 170141183460469231731687303715884105728;
    tag bytea;
    u numeric;
    lo numeric;
    hi numeric;
BEGIN
    -- NaN (and, from PostgreSQL 14, infinity) compares above every number.
    IF v = 'NaN'::numeric OR v < -two127 OR v >= 2 * two127 THEN
        RAISE EXCEPTION 'lockkit: % is not an integer from -2^127 to 2^128 - 1', v
            USING ERRCODE = 'numeric_value_out_of_range';
    END IF;
    IF v <> trunc(v) THEN
        RAISE EXCEPTION 'lockkit: % is not an integer', v USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v >= -9223372036854775808 AND v <= 9223372036854775807 THEN
        RETURN lockkit.int(v::bigint);
    END IF;
    IF v < two127 THEN
        tag := decode('02', 'hex');  -- i128, two's complement
        u := CASE WHEN v < 0 THEN v + 2 * two127 ELSE v END;
    ELSE
        tag := decode('03', 'hex');  -- a u128 above i128::MAX
        u := v;
    END IF;
    -- The low and the high 64 bits, each as the bits of a bigint.
    lo := mod(u, two64);
    hi := div(u, two64);
    RETURN tag
        || lockkit.i64le((CASE WHEN lo >= two64 / 2 THEN lo - two64 ELSE lo END)::bigint)
        || lockkit.i64le((CASE WHEN hi >= two64 / 2 THEN hi - two64 ELSE hi END)::bigint);
END
$$;

-- A bool: `04 00` for false, `04 01` for true.
CREATE OR REPLACE FUNCTION lockkit.bool(v boolean) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN CASE WHEN v THEN decode('0401', 'hex') ELSE decode('0400', 'hex') END;
END
$$;

-- A char by its Unicode scalar value: `05 ++ u32le(value)`.
CREATE OR REPLACE FUNCTION lockkit.char(v integer) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF v < 0 OR v > 1114111 OR (v >= 55296 AND v <= 57343) THEN
        RAISE EXCEPTION 'lockkit: % is not a Unicode scalar value', v
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN decode('05', 'hex') || substr(int4send(((v & 255) << 24) | (((v >> 8) & 255) << 16)
        | (((v >> 16) & 255) << 8)), 1, 4);
END
$$;

-- A char: `05 ++ u32le(Unicode scalar value)` of the one character of `v`.
-- The character is read from the UTF-8 bytes of `v`, whatever the database
-- encoding. A SQL_ASCII database stores text as the bytes the client sent,
-- with no encoding: there they are taken as UTF-8 (what a UTF-8 client,
-- psql's and every lockkit driver's default, sends: 'é' arrives as c3 a9),
-- so the key is the one Rust computes for the same char; bytes that are not
-- exactly one well-formed UTF-8 character are refused.
CREATE OR REPLACE FUNCTION lockkit.char(v text) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    ascii boolean := current_setting('server_encoding') = 'SQL_ASCII';
    b bytea;
    n integer;
    chars integer := 0;
    lead integer;
    c integer;
    shown text;
BEGIN
    -- In SQL_ASCII the bytes as they are (converting them to UTF-8 would
    -- refuse those that are not, with an error that does not say why they
    -- must be), and an error message shows them in hex, so that it reaches
    -- the client intact; elsewhere the text converted to UTF-8.
    b := CASE WHEN ascii THEN convert_to(v, 'SQL_ASCII') ELSE convert_to(v, 'UTF8') END;
    n := octet_length(b);
    shown := CASE WHEN ascii THEN 'bytes ' || encode(b, 'hex') ELSE '"' || v || '"' END;
    -- Characters: the bytes that do not continue one (10xxxxxx).
    FOR i IN 0 .. n - 1 LOOP
        IF get_byte(b, i) & 192 <> 128 THEN
            chars := chars + 1;
        END IF;
    END LOOP;
    IF chars <> 1 OR n > 4 THEN
        RAISE EXCEPTION 'lockkit: a char is one character, not % (%)', chars, shown
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    lead := get_byte(b, 0);
    c := CASE n
        WHEN 1 THEN lead
        WHEN 2 THEN ((lead & 31) << 6) | (get_byte(b, 1) & 63)
        WHEN 3 THEN ((lead & 15) << 12) | ((get_byte(b, 1) & 63) << 6) | (get_byte(b, 2) & 63)
        ELSE ((lead & 7) << 18) | ((get_byte(b, 1) & 63) << 12) | ((get_byte(b, 2) & 63) << 6)
            | (get_byte(b, 3) & 63)
    END;
    -- Well-formed UTF-8 only (a SQL_ASCII database holds any bytes): the
    -- lead byte announces the length, the value is a Unicode scalar value,
    -- and it is written in its shortest form.
    -- (Each CASE in parentheses: PL/pgSQL ends an IF's condition at the
    -- first THEN outside them.)
    IF (lead & (CASE n WHEN 1 THEN 128 WHEN 2 THEN 224 WHEN 3 THEN 240 ELSE 248 END))
            <> (CASE n WHEN 1 THEN 0 WHEN 2 THEN 192 WHEN 3 THEN 224 ELSE 240 END)
        OR c < (CASE n WHEN 1 THEN 0 WHEN 2 THEN 128 WHEN 3 THEN 2048 ELSE 65536 END)
        OR c > 1114111 OR (c >= 55296 AND c <= 57343) THEN
        RAISE EXCEPTION 'lockkit: a char is one UTF-8 character, not %', shown
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN decode('05', 'hex') || substr(int4send(((c & 255) << 24) | (((c >> 8) & 255) << 16)
        | (((c >> 16) & 255) << 8)), 1, 4);
END
$$;

-- A string: `06 ++ u32le(length in bytes) ++ utf8`.
CREATE OR REPLACE FUNCTION lockkit.str(v text) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    b bytea := convert_to(v, 'UTF8');
    n bigint := octet_length(b);
BEGIN
    RETURN decode('06', 'hex') || substr(int8send(((n & 255) << 56) | (((n >> 8) & 255) << 48)
        | (((n >> 16) & 255) << 40) | (((n >> 24) & 255) << 32)), 1, 4) || b;
END
$$;

-- A uuid: `08 ++ the 16 bytes in RFC 4122 (big-endian) order`.
CREATE OR REPLACE FUNCTION lockkit.uuid(v uuid) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN decode('08', 'hex') || uuid_send(v);
END
$$;

-- Option::None: `09 00`.
CREATE OR REPLACE FUNCTION lockkit.none() RETURNS bytea
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN decode('0900', 'hex');
END
$$;

-- Option::Some: `09 01 ++ enc(v)`, given `part` = enc(v).
CREATE OR REPLACE FUNCTION lockkit.some(part bytea) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN decode('0901', 'hex') || part;
END
$$;

-- An Option from a nullable encoding: None for NULL, else Some(part), e.g.
-- lockkit.option(lockkit.int(parent_id)) for a nullable column.
CREATE OR REPLACE FUNCTION lockkit.option(part bytea) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN CASE WHEN part IS NULL THEN decode('0900', 'hex') ELSE decode('0901', 'hex') || part END;
END
$$;

-- A sequence (slice, Vec, array): `0A ++ u32le(number of elements) ++ enc
-- of each`. An array column's elements, in order:
-- lockkit.seq(VARIADIC ARRAY(SELECT lockkit.int(x) FROM unnest(ids) WITH ORDINALITY AS u(x, i) ORDER BY i))
CREATE OR REPLACE FUNCTION lockkit.seq(VARIADIC items bytea[]) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n bigint := coalesce(cardinality(items), 0);
    out bytea;
    item bytea;
BEGIN
    IF items IS NULL THEN
        RAISE EXCEPTION 'lockkit: a sequence''s items are NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    out := decode('0a', 'hex') || substr(int8send(((n & 255) << 56) | (((n >> 8) & 255) << 48)
        | (((n >> 16) & 255) << 40) | (((n >> 24) & 255) << 32)), 1, 4);
    FOREACH item IN ARRAY items LOOP
        IF item IS NULL THEN
            RAISE EXCEPTION 'lockkit: a sequence item is NULL' USING ERRCODE = 'null_value_not_allowed';
        END IF;
        out := out || item;
    END LOOP;
    RETURN out;
END
$$;

-- The empty sequence.
CREATE OR REPLACE FUNCTION lockkit.seq() RETURNS bytea
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN decode('0a00000000', 'hex');
END
$$;

-- A tuple, or a nested key type: its parts concatenated (listing them as
-- parts of the key, or joining them with ||, is the same).
CREATE OR REPLACE FUNCTION lockkit.tuple(VARIADIC parts bytea[]) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    out bytea := decode('', 'hex');
    part bytea;
BEGIN
    FOREACH part IN ARRAY parts LOOP
        IF part IS NULL THEN
            RETURN NULL;
        END IF;
        out := out || part;
    END LOOP;
    RETURN out;
END
$$;

-- An enum variant (derived): `0C ++ u32le(length of its name) ++ utf8(name)
-- ++ enc of its fields`. The name is the Rust identifier, without `r#`.
CREATE OR REPLACE FUNCTION lockkit.variant(name text, VARIADIC fields bytea[]) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    b bytea := convert_to(name, 'UTF8');
    n bigint := octet_length(b);
    out bytea;
    field bytea;
BEGIN
    out := decode('0c', 'hex') || substr(int8send(((n & 255) << 56) | (((n >> 8) & 255) << 48)
        | (((n >> 16) & 255) << 40) | (((n >> 24) & 255) << 32)), 1, 4) || b;
    FOREACH field IN ARRAY fields LOOP
        IF field IS NULL THEN
            RETURN NULL;
        END IF;
        out := out || field;
    END LOOP;
    RETURN out;
END
$$;

-- A variant without fields.
CREATE OR REPLACE FUNCTION lockkit.variant(name text) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    b bytea := convert_to(name, 'UTF8');
    n bigint := octet_length(b);
BEGIN
    RETURN decode('0c', 'hex') || substr(int8send(((n & 255) << 56) | (((n >> 8) & 255) << 48)
        | (((n >> 16) & 255) << 40) | (((n >> 24) & 255) << 32)), 1, 4) || b;
END
$$;

-- Namespaces and keys.

-- The namespace's bytes, after checking it: 1 to 64 bytes, each an ASCII
-- letter or digit or one of `_ . : / -`.
CREATE OR REPLACE FUNCTION lockkit.namespace_bytes(ns text) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF ns IS NULL THEN
        RAISE EXCEPTION 'lockkit: the namespace is NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF octet_length(ns) NOT BETWEEN 1 AND 64 OR ns !~ '^[A-Za-z0-9_.:/-]+$' THEN
        RAISE EXCEPTION 'lockkit: invalid namespace "%": 1 to 64 ASCII letters, digits and _ . : / -', ns
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN convert_to(ns, 'UTF8');
END
$$;

-- ns_hash(ns) = sip("ns" ++ 0x00 ++ utf8(ns)).
CREATE OR REPLACE FUNCTION lockkit.ns_hash(ns text) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN lockkit.sip(decode('6e7300', 'hex') || lockkit.namespace_bytes(ns));
END
$$;

-- tag16(ns) = ns_hash(ns) >> 48 (0 to 65535): the top 16 bits of every
-- hashed BigInt key of the namespace, so the top 16 bits of its `classid`
-- in pg_locks.
CREATE OR REPLACE FUNCTION lockkit.tag(ns text) RETURNS integer
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN ((lockkit.ns_hash(ns) >> 48) & 65535)::integer;
END
$$;

-- The class of the namespace's hashed Pair keys: the upper 32 bits of
-- ns_hash as an int4. (A type with `class = N` uses N.)
CREATE OR REPLACE FUNCTION lockkit.pair_class(ns text) RETURNS integer
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (lockkit.ns_hash(ns) >> 32)::integer;
END
$$;

-- body(ns, parts) = sip(u32le(len(utf8(ns))) ++ utf8(ns) ++ parts).
CREATE OR REPLACE FUNCTION lockkit.body(ns text, parts bytea) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    b bytea := lockkit.namespace_bytes(ns);
BEGIN
    IF parts IS NULL THEN
        RAISE EXCEPTION 'lockkit: the key parts are NULL (lockkit.option(...) encodes a NULL as None)'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    RETURN lockkit.sip(lockkit.u32le(octet_length(b)) || b || parts);
END
$$;

-- The common body of the key functions: the BigInt key (`pair` false) or
-- the Pair object (`pair` true) of namespace `ns` and `parts`, folded onto
-- `stripes` keys unless it is NULL. Everything but SipHash is inline: each
-- call of a function with its own search_path costs microseconds.
CREATE OR REPLACE FUNCTION lockkit.hashed_key(ns text, parts bytea[], stripes numeric, pair boolean)
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    two64 CONSTANT numeric := 18446744073709551616;
    b bytea;
    msg bytea;
    part bytea;
    body bigint;
    folded numeric;
BEGIN
    IF ns IS NULL THEN
        RAISE EXCEPTION 'lockkit: the namespace is NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF octet_length(ns) NOT BETWEEN 1 AND 64 OR ns !~ '^[A-Za-z0-9_.:/-]+$' THEN
        RAISE EXCEPTION 'lockkit: invalid namespace "%": 1 to 64 ASCII letters, digits and _ . : / -', ns
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF parts IS NULL THEN
        RAISE EXCEPTION 'lockkit: the key parts are NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    b := convert_to(ns, 'UTF8');
    -- u32le(len(ns)): the length is at most 64, one byte.
    msg := set_byte(decode('00000000', 'hex'), 0, octet_length(b)) || b;
    FOREACH part IN ARRAY parts LOOP
        IF part IS NULL THEN
            RAISE EXCEPTION 'lockkit: a key part is NULL (lockkit.option(...) encodes a NULL as None)'
                USING ERRCODE = 'null_value_not_allowed';
        END IF;
        msg := msg || part;
    END LOOP;
    body := lockkit.sip(msg);
    IF stripes IS NOT NULL THEN
        IF stripes = 'NaN'::numeric OR stripes < 1 OR stripes >= two64 OR stripes <> trunc(stripes) THEN
            RAISE EXCEPTION 'lockkit: stripes must be an integer from 1 to 2^64 - 1, not %', stripes
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- body % stripes, with body read as unsigned.
        folded := mod(CASE WHEN body < 0 THEN body + two64 ELSE body::numeric END, stripes);
        body := (CASE WHEN folded >= two64 / 2 THEN folded - two64 ELSE folded END)::bigint;
    END IF;
    IF pair THEN
        -- The lower 32 bits, as a signed int4 (sign-extended).
        RETURN (body << 32) >> 32;
    END IF;
    -- (tag16 << 48) | (body & 0xFFFF_FFFF_FFFF).
    RETURN (lockkit.sip(decode('6e7300', 'hex') || b) & -281474976710656) | (body & 281474976710655);
END
$$;

-- The BigInt key (the derive's default) of a value of namespace `ns` whose
-- fields, in declaration order, encode to `parts`.
CREATE OR REPLACE FUNCTION lockkit.key(ns text, VARIADIC parts bytea[]) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN lockkit.hashed_key(ns, parts, NULL, false);
END
$$;

-- The BigInt key of a type without fields.
CREATE OR REPLACE FUNCTION lockkit.key(ns text) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN lockkit.hashed_key(ns, ARRAY[]::bytea[], NULL, false);
END
$$;

-- The BigInt key of a type with `stripes = N` (1 <= N < 2^64).
CREATE OR REPLACE FUNCTION lockkit.striped_key(ns text, stripes numeric, VARIADIC parts bytea[])
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF stripes IS NULL THEN
        RAISE EXCEPTION 'lockkit: stripes is NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    RETURN lockkit.hashed_key(ns, parts, stripes, false);
END
$$;

-- The object of the hashed Pair key (`pair`, or `class = N`): the lower 32
-- bits of the body as an int4. The key is (lockkit.pair_class(ns), this),
-- or (N, this) with an explicit class.
CREATE OR REPLACE FUNCTION lockkit.pair_object(ns text, VARIADIC parts bytea[]) RETURNS integer
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN lockkit.hashed_key(ns, parts, NULL, true)::integer;
END
$$;

-- The Pair object of a type without fields.
CREATE OR REPLACE FUNCTION lockkit.pair_object(ns text) RETURNS integer
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN lockkit.hashed_key(ns, ARRAY[]::bytea[], NULL, true)::integer;
END
$$;

-- The Pair object of a type with `stripes = N` (1 <= N < 2^64).
CREATE OR REPLACE FUNCTION lockkit.striped_pair_object(ns text, stripes numeric,
    VARIADIC parts bytea[])
RETURNS integer
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF stripes IS NULL THEN
        RAISE EXCEPTION 'lockkit: stripes is NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    RETURN lockkit.hashed_key(ns, parts, stripes, true)::integer;
END
$$;
