-- idem: the table's first automatic ANALYZE waits until the table has rows
-- enough for its primary key to be the cheaper way to a key.
--
-- idem's key lookups are prepared statements (SQL PREPARE on the session path,
-- sqlx's prepared statements elsewhere). PostgreSQL gives each session a generic
-- plan for them, built once and kept until the table's statistics change. Built
-- after an ANALYZE that saw the table at a few pages (autovacuum's default
-- threshold is 50 changed rows), that plan is a sequential scan, and the session
-- keeps it while the table grows until the next ANALYZE (up to
-- autovacuum_naptime later): measured, a probe planned at 20 rows read 50,000
-- rows a call, 8 ms, where the primary key takes a few microseconds. Before any
-- ANALYZE the planner takes a table for ten pages or more and plans the key;
-- past about seven pages it does either way. So the first ANALYZE waits for
-- 1,000 changed rows (about 30 pages of finished rows), as the first VACUUM of
-- an insert-only table already does (autovacuum_vacuum_insert_threshold).
--
-- A storage parameter: it takes only a SHARE UPDATE EXCLUSIVE lock, so applying
-- it to a table in use blocks neither reads nor writes.

ALTER TABLE idempotency_requests SET (autovacuum_analyze_threshold = 1000);
