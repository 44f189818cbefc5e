
-- ---------------------------------------------------------------------------
-- Fencing tokens (docs/FENCING.md).
--
-- A lock holder can be stale without knowing it: paused past its lease, or
-- cut off by a failover. A fencing token is a number minted with the grant
-- that is larger than every token minted before for any key, so the
-- protected resource can refuse a write whose token is older than one it
-- has already seen.
--
--   lockkit.fencing_token()          mints a token (numeric); lockkit's
--                                    lock statements compute the same
--                                    number from its three parts, right
--                                    after the grant, in the same round
--                                    trip
--   lockkit.fence(resource, token)   true, and the resource's newest token
--                                    set to `token`, when `token` is at
--                                    least the newest it has seen; false
--                                    otherwise; an error for what is no
--                                    token. Call it in the transaction
--                                    of the protected write:
--     UPDATE invoices SET paid = true
--      WHERE id = 42 AND lockkit.fence('invoice:42', $token);
--   lockkit.fences                   the newest token per resource
--
-- A token is timeline * 2^112 + flush * 2^48 + counter, where
--   timeline  the server's WAL timeline (it grows at every promotion of a
--             standby), read from the name of the current WAL file;
--   flush     pg_current_wal_flush_lsn() as a number: WAL known to be on
--             disk, which grows over a crash and its recovery;
--   counter   nextval('lockkit.fencing_counter'), below 2^48.
-- Tokens grow with the timeline first, so a promoted standby mints larger
-- tokens than its old primary ever did, unreplicated ones included; then
-- with the flushed WAL, so a crash that loses the counter's last values
-- cannot make a token repeat; then with the counter.
--
-- Both functions are SECURITY DEFINER: a role that may call them needs no
-- privilege on the sequence or the table. They pin their search_path and
-- name every object by schema. Calling them (and minting with a lock)
-- needs USAGE on the schema lockkit, which this script grants to nobody:
-- GRANT USAGE ON SCHEMA lockkit TO app_role (docs/FENCING.md, "Who may
-- call it").

CREATE SEQUENCE IF NOT EXISTS lockkit.fencing_counter AS bigint
    MINVALUE 1 MAXVALUE 281474976710655 NO CYCLE;

-- lockkit's lock statements read the counter themselves, next to the lock
-- (the same number as lockkit.fencing_token(), without a function call): any
-- role that may use the schema may take its next value. Nobody but its owner
-- may set it (setval needs UPDATE).
GRANT USAGE ON SEQUENCE lockkit.fencing_counter TO PUBLIC;

CREATE TABLE IF NOT EXISTS lockkit.fences (
    resource text PRIMARY KEY,
    token numeric NOT NULL
);

COMMENT ON TABLE lockkit.fences IS
    'lockkit fencing: the newest token seen per protected resource (lockkit.fence)';

-- Mints a fencing token (docs/FENCING.md). On a hot standby it fails, as
-- nextval does.
CREATE OR REPLACE FUNCTION lockkit.fencing_token() RETURNS numeric
LANGUAGE sql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT ('x' || substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))
                ::bit(32)::int8::numeric * 5192296858534827628530496329220096
         + (pg_catalog.pg_current_wal_flush_lsn() - '0/0'::pg_catalog.pg_lsn) * 281474976710656
         + pg_catalog.nextval('lockkit.fencing_counter'::pg_catalog.regclass)
$$;

-- true when `token` is at least the newest token `resource` has seen, which
-- it then becomes; false when `token` is older (a stale holder's write).
-- Only a token is taken, a whole number in [0, 2^128): anything else (NaN,
-- an infinity, a negative or fractional number, 2^128 or more) raises
-- SQLSTATE 22023 (invalid_parameter_value), and a NULL resource or token
-- 22004 (null_value_not_allowed); never false, which means stale, and
-- never true (stored, such a number would sort above every token and
-- refuse them all, for good). The resource's row stays locked until the
-- transaction ends, so two writers fence one at a time.
CREATE OR REPLACE FUNCTION lockkit.fence(resource text, token numeric) RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    IF $1 IS NULL OR $2 IS NULL THEN
        RAISE EXCEPTION 'lockkit.fence: the resource and the token must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- In parentheses: PL/pgSQL ends an IF's condition at the first THEN.
    IF (CASE
        WHEN $2 OPERATOR(pg_catalog.=) 'NaN'::numeric THEN true
        WHEN $2 OPERATOR(pg_catalog.<) 0
          OR $2 OPERATOR(pg_catalog.>=) 340282366920938463463374607431768211456 THEN true
        ELSE $2 OPERATOR(pg_catalog.<>) pg_catalog.trunc($2)
    END) THEN
        RAISE EXCEPTION 'lockkit.fence: not a fencing token: %', pg_catalog.left($2::text, 60)
            USING ERRCODE = 'invalid_parameter_value',
                  DETAIL = 'A fencing token is a whole number from 0 to 2^128 - 1 (docs/FENCING.md).';
    END IF;
    INSERT INTO lockkit.fences AS f (resource, token) VALUES ($1, $2)
    ON CONFLICT (resource) DO UPDATE SET token = excluded.token
    WHERE f.token OPERATOR(pg_catalog.<=) excluded.token;
    RETURN FOUND;
END
$$;

-- A fence of an earlier version took any number: a row it left holding
-- no token (NaN, an infinity, a negative or fractional number, 2^128 or
-- more) refused every real token for good. Such a row now holds a fresh
-- token: holders whose tokens were minted before it stay refused, as they
-- were, and the next holders are accepted again. Nothing to do when no
-- row is such (always, once this version fenced alone).
UPDATE lockkit.fences SET token = lockkit.fencing_token()
 WHERE CASE
     WHEN token OPERATOR(pg_catalog.=) 'NaN'::numeric THEN true
     WHEN token OPERATOR(pg_catalog.<) 0
       OR token OPERATOR(pg_catalog.>=) 340282366920938463463374607431768211456 THEN true
     ELSE token OPERATOR(pg_catalog.<>) pg_catalog.trunc(token)
 END;
