//! Admission across gateway replicas at the store level, on a real PostgreSQL
//! (tests/pg): a replica whose heartbeat went stale has its streaming turn taken
//! over by a retry (the old row and token log replaced, never kept beside the
//! new), its late writes are fenced off, and its streaming turn of another ID
//! stops blocking the conversation.

mod pg;

use baton_api_gateway::store::{
    conformance, now_unix, BeginTurn, Conversation, ConversationStore, LogEntry, PostgresStore, Turn, TurnEnd,
    TurnState,
};

fn conv(id: &str) -> Conversation {
    conformance::conv(id, "alice", now_unix())
}

fn turn(conv: &str, id: &str, seq: i64) -> Turn {
    Turn { seq, ..conformance::streaming_turn(conv, id) }
}

fn done(text: &str) -> TurnEnd {
    TurnEnd {
        state: TurnState::Done,
        reply_text: text.into(),
        output_ids: vec![9],
        finish_reason: "stop".into(),
        prompt_tokens: 3,
        cached_tokens: 0,
        completion_tokens: 1,
    }
}

/// Makes every replica's heartbeat stale (as if they had all stopped beating);
/// a store's own decisions never depend on its own heartbeat.
async fn stale_heartbeats(url: &str) {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .execute("UPDATE gateway_instances SET seen_at = 0", &[])
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_replicas_turn_is_taken_over_and_its_late_writes_are_fenced() {
    let Some(pg) = pg::TempPostgres::start() else {
        return;
    };
    let url = pg.url();
    // Default staleness (60 s): heartbeats every 10 s, so the stale rows set below
    // stay stale for the length of the test.
    let old = PostgresStore::connect(&url).await.unwrap();
    let new = PostgresStore::connect(&url).await.unwrap();
    old.create_conversation(&conv("c1")).await.unwrap();
    assert!(matches!(
        old.begin_turn(&turn("c1", "t1", 0)).await.unwrap(),
        BeginTurn::Created
    ));
    old.append_log(
        "c1",
        "t1",
        &[
            LogEntry {
                index: 0,
                text: "old ".into(),
            },
            LogEntry {
                index: 1,
                text: "run".into(),
            },
        ],
    )
    .await
    .unwrap();
    // While its replica is alive, the turn runs elsewhere and cannot be taken over.
    assert!(new.turn_runs_elsewhere("c1", "t1").await.unwrap());
    assert!(
        !old.turn_runs_elsewhere("c1", "t1").await.unwrap(),
        "a replica's own turn does not run elsewhere"
    );
    match new.begin_turn(&turn("c1", "t1", 1)).await.unwrap() {
        BeginTurn::Existing(t) => assert_eq!(t.state, TurnState::Streaming),
        other => panic!("a live replica's turn must stay its own: {other:?}"),
    }

    stale_heartbeats(&url).await;
    assert!(
        !new.turn_runs_elsewhere("c1", "t1").await.unwrap(),
        "a stale replica's turn runs nowhere"
    );
    assert!(
        matches!(
            new.begin_turn(&turn("c1", "t1", 1)).await.unwrap(),
            BeginTurn::Created
        ),
        "the retry takes the turn over"
    );
    assert!(
        new.read_log("c1", "t1", 0).await.unwrap().is_empty(),
        "the old attempt's log goes with it"
    );
    // The old replica wakes up: its writes no longer land.
    old.append_log(
        "c1",
        "t1",
        &[LogEntry {
            index: 0,
            text: "late".into(),
        }],
    )
    .await
    .unwrap();
    old.finish_turn("c1", "t1", &done("late")).await.unwrap();
    let t = new.get_turn("c1", "t1").await.unwrap().unwrap();
    assert_eq!(
        (t.state, t.seq),
        (TurnState::Streaming, 1),
        "the taker's row is untouched"
    );
    assert!(
        new.read_log("c1", "t1", 0).await.unwrap().is_empty(),
        "a fenced replica writes no log"
    );
    new.append_log(
        "c1",
        "t1",
        &[LogEntry {
            index: 0,
            text: "new".into(),
        }],
    )
    .await
    .unwrap();
    new.finish_turn("c1", "t1", &done("new")).await.unwrap();
    let turns = new.list_turns("c1").await.unwrap();
    assert_eq!(turns.len(), 1, "stored once: {turns:?}");
    assert_eq!(
        (turns[0].state, turns[0].reply_text.as_str()),
        (TurnState::Done, "new")
    );
    assert_eq!(
        new.read_log("c1", "t1", 0).await.unwrap(),
        vec![LogEntry {
            index: 0,
            text: "new".into()
        }]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_replicas_other_turn_stops_blocking_the_conversation() {
    let Some(pg) = pg::TempPostgres::start() else {
        return;
    };
    let url = pg.url();
    let old = PostgresStore::connect(&url).await.unwrap();
    let new = PostgresStore::connect(&url).await.unwrap();
    old.create_conversation(&conv("c2")).await.unwrap();
    assert!(matches!(
        old.begin_turn(&turn("c2", "t1", 0)).await.unwrap(),
        BeginTurn::Created
    ));
    // A live replica's turn in progress: another turn is refused.
    assert!(matches!(
        new.begin_turn(&turn("c2", "t2", 1)).await.unwrap(),
        BeginTurn::Busy
    ));
    stale_heartbeats(&url).await;
    assert!(matches!(
        new.begin_turn(&turn("c2", "t2", 1)).await.unwrap(),
        BeginTurn::Created
    ));
    let t1 = new.get_turn("c2", "t1").await.unwrap().unwrap();
    assert_eq!(
        (t1.state, t1.finish_reason.as_deref()),
        (TurnState::Failed, Some("interrupted"))
    );
    old.finish_turn("c2", "t1", &done("late")).await.unwrap();
    assert_eq!(
        new.get_turn("c2", "t1").await.unwrap().unwrap().state,
        TurnState::Failed,
        "the dead replica's end is not stored"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_replicas_admit_one_turn_per_conversation() {
    let Some(pg) = pg::TempPostgres::start() else {
        return;
    };
    let url = pg.url();
    let a = std::sync::Arc::new(PostgresStore::connect(&url).await.unwrap());
    let b = std::sync::Arc::new(PostgresStore::connect(&url).await.unwrap());
    a.create_conversation(&conv("c3")).await.unwrap();
    // 20 different turns, all built on the same (empty) history, through two replicas.
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let s = if i % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(async move {
                s.begin_turn(&turn("c3", &format!("t{i}"), 0))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut created = 0;
    for t in tasks {
        match t.await.unwrap() {
            BeginTurn::Created => created += 1,
            BeginTurn::Busy => {}
            BeginTurn::Existing(t) => panic!("distinct turn IDs never exist: {t:?}"),
        }
    }
    assert_eq!(created, 1, "exactly one of 20 racing turns is admitted");
    assert_eq!(a.list_turns("c3").await.unwrap().len(), 1);
}
