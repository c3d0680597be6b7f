-- idem: the handler's path writes one row per execution, with bound parameters.
--
-- Until this migration, #[idempotent] handlers claimed their key with
-- idem_precheck and idem_take, sent as SQL text together with BEGIN, and stored
-- their outcome with idem_finish, sent with COMMIT. The runtime now looks the key
-- up with one prepared SELECT before the transaction, and inserts the finished
-- row once, with a prepared INSERT ... ON CONFLICT before COMMIT (see
-- idem-runtime/src/db/postgres/hot_path.rs): no function of idem's runs on that
-- path any more. idem_claim (hand-written claims, and the handler's path with
-- claims at commit turned off) and idem_claim_leased stay.
--
-- An older release still running against this database finds the functions gone
-- (SQLSTATE 42883), turns its pipelined claims off and claims with idem_claim,
-- which is still here: it keeps working during a rolling upgrade.

DROP FUNCTION IF EXISTS idem_precheck(text, text, bytea, bytea);
DROP FUNCTION IF EXISTS idem_take(text, text, bytea, bytea, bigint, bigint);
DROP FUNCTION IF EXISTS idem_finish(text, text, bytea, bigint, text, smallint, jsonb, bytea, bigint);
