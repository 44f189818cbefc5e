//! For the Diesel adapters (`lockkit-diesel` and `lockkit-diesel-async`,
//! feature `diesel`): the engine's statements as Diesel queries and its
//! replies as Diesel rows, written once for both. Applications do not need
//! this module.
//!
//! An adapter runs [`EngineQuery`] with its own connection
//! (`get_result::<`[`EngineRow`]`>`, for every statement that answers a
//! row), keeps the row in an [`Answer`], and hands [`Answer::reply`] to the
//! engine.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{Array, BigInt, Bool, Integer, Text, Untyped};
use diesel::{QueryResult, QueryableByName, RunQueryDsl};

use crate::driver::{DriverError, Policy};
use crate::engine::error::sqlstate;
use crate::engine::{FactsRow, Param, Reply, Statement};
use crate::{Config, Error, ServerFacts, StatementMode};

/// One of the engine's statements (one that answers a row) as a Diesel
/// query.
///
/// With [`StatementMode::Prepared`], Diesel's statement cache keeps it: it is
/// prepared on the connection the first time, by its SQL text, and only bound
/// and executed after that (unless the connection's cache is disabled).
/// `diesel::sql_query`, by contrast, is never cached: the server parses and
/// plans it every time, which is what [`StatementMode::Unnamed`] does, for
/// poolers that do not keep named statements. Behind a pooler that mixes up
/// named statements anyway, the engine's reply check turns a foreign
/// statement's answer into an error, never a success.
#[derive(Debug)]
pub struct EngineQuery<'s, 'a> {
    stmt: &'s Statement<'a>,
    cached: bool,
}

impl<'s, 'a> EngineQuery<'s, 'a> {
    /// `stmt` as a Diesel query, cached or not as `mode` says.
    pub fn new(stmt: &'s Statement<'a>, mode: StatementMode) -> Self {
        EngineQuery {
            stmt,
            cached: mode == StatementMode::Prepared,
        }
    }
}

impl QueryId for EngineQuery<'_, '_> {
    type QueryId = ();
    // Not static: Diesel caches the query by its SQL text and bind types.
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl Query for EngineQuery<'_, '_> {
    type SqlType = Untyped;
}

impl<Conn> RunQueryDsl<Conn> for EngineQuery<'_, '_> {}

/// The placeholders of lockkit's statements, by parameter.
const PLACEHOLDERS: [&str; 3] = ["$1", "$2", "$3"];

impl QueryFragment<Pg> for EngineQuery<'_, '_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        if !self.cached {
            out.unsafe_to_cache_prepared();
        }
        // Diesel numbers a query's binds itself, and its public AST cannot
        // bind a placeholder already in the text; lockkit's statements name
        // each parameter once, in order (see `engine::sql`), so each
        // placeholder gives way to Diesel's own, in the same place.
        let mut rest = self.stmt.text();
        for (param, placeholder) in self.stmt.params().iter().zip(PLACEHOLDERS) {
            let Some(at) = rest.find(placeholder) else {
                return Err(diesel::result::Error::QueryBuilderError(
                    format!("lockkit's {:?} has no {placeholder}", self.stmt.sql()).into(),
                ));
            };
            out.push_sql(&rest[..at]);
            rest = &rest[at + placeholder.len()..];
            match param {
                Param::Int8(v) => out.push_bind_param::<BigInt, i64>(v)?,
                Param::Int4(v) => out.push_bind_param::<Integer, i32>(v)?,
                Param::Int8Array(v) => out.push_bind_param::<Array<BigInt>, [i64]>(v)?,
                Param::Int4Array(v) => out.push_bind_param::<Array<Integer>, [i32]>(v)?,
                Param::BoolArray(v) => out.push_bind_param::<Array<Bool>, [bool]>(v)?,
            }
        }
        out.push_sql(rest);
        Ok(())
    }
}

/// The row of any of the engine's statements that answer one, read by
/// column name: `tag` always; `n`, `busy`, `busy_class` and `busy_object`
/// where the statement's [`ReplyShape`](crate::driver::ReplyShape) has them;
/// and a minting statement's token (`timeline`, `flush`, `counter`). A
/// column the statement does not have is absent, and [`Answer::reply`]
/// reads what the statement answers.
#[derive(Debug)]
pub struct EngineRow {
    tag: i64,
    n: Option<i64>,
    busy: Option<Vec<i64>>,
    busy_class: Option<Vec<i32>>,
    busy_object: Option<Vec<i32>>,
    token: Option<[i64; 3]>,
}

/// Column `name` of `row` as `T` (of SQL type `ST`), `None` when the row
/// has no such column.
fn column<'a, ST, T>(
    row: &impl diesel::row::NamedRow<'a, Pg>,
    name: &str,
) -> diesel::deserialize::Result<Option<T>>
where
    T: diesel::deserialize::FromSql<ST, Pg>,
{
    match diesel::row::Row::get(row, name) {
        None => Ok(None),
        Some(_) => diesel::row::NamedRow::get::<ST, T>(row, name).map(Some),
    }
}

impl QueryableByName<Pg> for EngineRow {
    fn build<'a>(row: &impl diesel::row::NamedRow<'a, Pg>) -> diesel::deserialize::Result<Self> {
        let token = match (
            column::<BigInt, i64>(row, "timeline")?,
            column::<BigInt, i64>(row, "flush")?,
            column::<BigInt, i64>(row, "counter")?,
        ) {
            (Some(timeline), Some(flush), Some(counter)) => Some([timeline, flush, counter]),
            _ => None,
        };
        Ok(EngineRow {
            tag: diesel::row::NamedRow::get::<BigInt, i64>(row, "tag")?,
            n: column::<BigInt, i64>(row, "n")?,
            busy: column::<Array<BigInt>, Vec<i64>>(row, "busy")?,
            busy_class: column::<Array<Integer>, Vec<i32>>(row, "busy_class")?,
            busy_object: column::<Array<Integer>, Vec<i32>>(row, "busy_object")?,
            token,
        })
    }
}

/// What the server answered one statement, owned.
#[derive(Debug)]
#[non_exhaustive]
pub enum Answer {
    /// A simple-protocol statement ([`ReplyShape::Done`](crate::driver::ReplyShape::Done)) completed.
    Done,
    /// The statement's row.
    Row(EngineRow),
}

impl Answer {
    /// The reply the engine checks, as `statement` answers it: its
    /// [`ReplyShape`](crate::driver::ReplyShape)'s columns (a column it lacks makes the reply
    /// malformed), then, for a minting statement, its token.
    pub fn reply(&self, statement: &Statement<'_>) -> Reply {
        use crate::engine::ReplyShape;
        let row = match self {
            Answer::Done if statement.reply() == ReplyShape::Done => return Reply::Done,
            Answer::Done => return Reply::Malformed("no row".into()),
            Answer::Row(row) => row,
        };
        let missing = |what: &str| Reply::Malformed(format!("no column {what}"));
        let reply = match statement.reply() {
            ReplyShape::Done => return Reply::Malformed("a row".into()),
            ReplyShape::Locked => Reply::Locked { tag: row.tag },
            ReplyShape::Tagged => match row.n {
                Some(n) => Reply::Tagged { tag: row.tag, n },
                None => return missing("n"),
            },
            ReplyShape::TriedBigint => match (row.n, &row.busy) {
                (Some(n), Some(busy)) => Reply::TriedBigint {
                    tag: row.tag,
                    n,
                    busy: busy.clone(),
                },
                _ => return missing("n or busy"),
            },
            ReplyShape::TriedPair => match (row.n, &row.busy_class, &row.busy_object) {
                (Some(n), Some(classes), Some(objects)) => Reply::TriedPair {
                    tag: row.tag,
                    n,
                    classes: classes.clone(),
                    objects: objects.clone(),
                },
                _ => return missing("n, busy_class or busy_object"),
            },
        };
        match (statement.is_minting(), row.token) {
            (false, _) => reply,
            (true, Some(token)) => Reply::Minted {
                reply: Box::new(reply),
                token,
            },
            (true, None) => missing("timeline, flush or counter"),
        }
    }
}

/// The row of [`SERVER_FACTS`](crate::driver::sql::SERVER_FACTS).
#[derive(Debug, QueryableByName)]
pub struct FactsColumns {
    #[diesel(sql_type = Integer)]
    max_locks: i32,
    #[diesel(sql_type = Integer)]
    max_connections: i32,
    #[diesel(sql_type = Bool)]
    in_recovery: bool,
    #[diesel(sql_type = Integer)]
    version_num: i32,
    #[diesel(sql_type = Array<Integer>)]
    hashes: Vec<i32>,
    #[diesel(sql_type = Integer)]
    backend_pid: i32,
}

impl From<FactsColumns> for FactsRow {
    fn from(row: FactsColumns) -> Self {
        FactsRow {
            max_locks: row.max_locks,
            max_connections: row.max_connections,
            in_recovery: row.in_recovery,
            version_num: row.version_num,
            hashes: row.hashes,
            backend_pid: row.backend_pid,
        }
    }
}

/// The row of [`MESSAGES`]: the server's `lc_messages`.
#[derive(Debug, QueryableByName)]
pub struct MessagesRow {
    #[diesel(sql_type = Text)]
    lc_messages: String,
}

/// Asks the server's `lc_messages`; its row is a [`MessagesRow`].
pub const MESSAGES: &str = crate::engine::sql::LC_MESSAGES;

impl MessagesRow {
    /// Whether the server reports errors in English, which reading Diesel's
    /// errors needs (Diesel hides the SQLSTATE: the English primary message
    /// names the codes its error kinds do not).
    pub fn english(&self) -> bool {
        let lc = self.lc_messages.to_ascii_lowercase();
        lc.is_empty() || lc == "c" || lc == "posix" || lc.starts_with("c.") || lc.starts_with("en")
    }
}

/// The policy of a Diesel adapter's locker, from what it learned on
/// connecting (the rows of [`SERVER_FACTS`](crate::driver::sql::SERVER_FACTS)
/// and [`MESSAGES`]): Diesel hides the SQLSTATE, so lockkit recognises its
/// errors only when the server's messages are English
/// ([`Policy::recognizes_errors`]). When they are not, a `tracing`
/// warning, naming `adapter`, says that deadlocks, timeouts and a full
/// lock table will be plain database errors.
pub fn learned_policy(
    config: Config,
    facts: &FactsRow,
    messages: &MessagesRow,
    adapter: &str,
) -> Policy {
    let english = messages.english();
    if !english {
        tracing::warn!(
            "{adapter}: the server's lc_messages is not English; deadlocks, lock \
             timeouts and a full lock table cannot be told apart from other database errors"
        );
    }
    Policy::new(config, ServerFacts::from(facts)).by_messages(english)
}

/// Diesel's error as the engine sees it. Diesel
/// does not expose the SQLSTATE: its `DatabaseErrorKind` names a few codes,
/// and the server's English primary message names the others.
impl From<diesel::result::Error> for DriverError {
    fn from(e: diesel::result::Error) -> Self {
        use diesel::result::{DatabaseErrorKind as Kind, Error as D};
        let (code, message, closed) = match &e {
            D::DatabaseError(kind, info) => {
                let code = match kind {
                    Kind::UniqueViolation => Some("23505"),
                    Kind::ForeignKeyViolation => Some("23503"),
                    Kind::NotNullViolation => Some("23502"),
                    Kind::CheckViolation => Some("23514"),
                    Kind::RestrictViolation => Some("23001"),
                    Kind::ExclusionViolation => Some("23P01"),
                    Kind::SerializationFailure => Some(sqlstate::SERIALIZATION_FAILURE),
                    Kind::ReadOnlyTransaction => Some("25006"),
                    _ => None,
                };
                (
                    code,
                    Some(info.message().to_owned()),
                    matches!(kind, Kind::ClosedConnection),
                )
            }
            _ => (None, None, false),
        };
        // A row without the columns asked for: in a lock call, the reply
        // of a statement that is not lockkit's.
        let foreign = matches!(e, D::DeserializationError(_));
        DriverError::new(e)
            .code(code)
            .message(message.as_deref())
            .closed(closed)
            .foreign_reply(foreign)
    }
}

/// So that `?` works inside
/// `conn.transaction::<_, lockkit::Error, _>(|conn| …)`.
impl From<diesel::result::Error> for Error {
    fn from(e: diesel::result::Error) -> Self {
        DriverError::from(e).into_error()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Sql;

    /// Every statement names each parameter once, in order: what
    /// `EngineQuery` relies on.
    #[test]
    fn every_statement_binds_in_order() {
        for sql in Sql::PREPARABLE {
            let mut rest = sql.text();
            for placeholder in &PLACEHOLDERS[..sql.param_types().len()] {
                let at = rest
                    .find('$')
                    .unwrap_or_else(|| panic!("{sql:?}: no {placeholder}"));
                assert!(
                    rest[at..].starts_with(placeholder),
                    "{sql:?}: {placeholder} out of order"
                );
                rest = &rest[at + placeholder.len()..];
            }
            assert!(!rest.contains('$'), "{sql:?} uses a parameter twice");
        }
    }

    #[test]
    fn reads_lc_messages() {
        let english = |lc: &str| {
            MessagesRow {
                lc_messages: lc.into(),
            }
            .english()
        };
        assert!(english("") && english("C") && english("en_US.UTF-8") && english("C.UTF-8"));
        assert!(!english("de_DE.UTF-8") && !english("fr_FR"));
    }

    /// Each kind Diesel names carries its SQLSTATE into lockkit's error (a
    /// deferred constraint's violation at `COMMIT` is reported by code).
    #[test]
    fn diesels_error_kinds_keep_their_sqlstate() {
        use diesel::result::{DatabaseErrorKind as Kind, Error as D};
        for (kind, code) in [
            (Kind::UniqueViolation, "23505"),
            (Kind::ForeignKeyViolation, "23503"),
            (Kind::NotNullViolation, "23502"),
            (Kind::CheckViolation, "23514"),
            (Kind::RestrictViolation, "23001"),
            (Kind::ExclusionViolation, "23P01"),
            (Kind::SerializationFailure, "40001"),
            (Kind::ReadOnlyTransaction, "25006"),
        ] {
            let e = Error::from(D::DatabaseError(kind, Box::new(String::from("violated"))));
            assert_eq!(e.code(), Some(code), "{kind:?}: {e}");
        }
    }
}
