
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
--                                    otherwise. Call it in the transaction
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
-- name every object by schema.

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
-- it then becomes; false when `token` is older (a stale holder's write);
-- NULL when either is NULL. The resource's row stays locked until the
-- transaction ends, so two writers fence one at a time.
CREATE OR REPLACE FUNCTION lockkit.fence(resource text, token numeric) RETURNS boolean
LANGUAGE sql VOLATILE STRICT PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH accepted AS (
        INSERT INTO lockkit.fences AS f (resource, token) VALUES ($1, $2)
        ON CONFLICT (resource) DO UPDATE SET token = excluded.token
        WHERE f.token OPERATOR(pg_catalog.<=) excluded.token
        RETURNING true
    )
    SELECT EXISTS (SELECT FROM accepted)
$$;
