-- idem: validates the constraint of 20261205000002 in a transaction of its own,
-- so that its scan of the table holds only a SHARE UPDATE EXCLUSIVE lock, which
-- blocks neither reads nor writes (in the same transaction as the ADD it would
-- scan under the exclusive lock).

ALTER TABLE idempotency_requests VALIDATE CONSTRAINT idempotency_requests_row_check;
