//! The conformance suite of [`ConversationStore`]: every implementation runs
//! it (the SQLite one in this crate's tests; a PostgreSQL one would call the
//! same [`run_all`]). Each check panics with what broke.

use super::*;

/// A turn streaming at place 0 of `conv`: the fixture every store test starts from
/// (this suite's turns and the PostgreSQL tests' turns), changed with struct update.
pub fn streaming_turn(conv: &str, id: &str) -> Turn {
    Turn {
        conversation: conv.into(),
        turn_id: id.into(),
        seq: 0,
        request_hash: "h".into(),
        user_text: "hi".into(),
        reply_text: String::new(),
        prompt_ids: vec![1, 2, 3],
        output_ids: vec![],
        system_prompt_version: 1,
        state: TurnState::Streaming,
        finish_reason: None,
        prompt_tokens: 0,
        cached_tokens: 0,
        completion_tokens: 0,
        created_at: now_unix(),
        metadata: Map::new(),
    }
}

fn turn(conv: &str, id: &str, seq: i64, hash: &str) -> Turn {
    Turn {
        seq,
        request_hash: hash.into(),
        user_text: format!("message {seq}"),
        prompt_ids: vec![1, 2, 3, seq as u32],
        ..streaming_turn(conv, id)
    }
}

/// A conversation of `owner`, created and last updated at `at` (Unix seconds).
pub fn conv(id: &str, owner: &str, at: i64) -> Conversation {
    Conversation {
        id: id.into(),
        owner: owner.into(),
        title: "t".into(),
        system_prompt_version: 1,
        created_at: at,
        updated_at: at,
        summary: None,
        metadata: Map::new(),
    }
}

/// How the suite ends a turn it no longer needs streaming: done, one token.
fn done() -> TurnEnd {
    TurnEnd {
        state: TurnState::Done,
        reply_text: "r".into(),
        output_ids: vec![1],
        finish_reason: "stop".into(),
        prompt_tokens: 1,
        cached_tokens: 0,
        completion_tokens: 1,
    }
}

/// Runs every check against a fresh (empty) store.
pub async fn run_all(s: &dyn ConversationStore) {
    keys(s).await;
    conversations_are_owner_scoped(s).await;
    turns_are_idempotent_and_exact(s).await;
    one_turn_admitted_at_a_time(s).await;
    metadata_is_stored_and_owner_scoped(s).await;
    history_rewrites_are_owned_and_guarded(s).await;
    delete_leaves_no_row(s).await;
    retention(s).await;
    tombstones(s).await;
    metering(s).await;
    limit_overrides(s).await;
}

async fn limit_overrides(s: &dyn ConversationStore) {
    use crate::limits::LimitOverrides;
    assert_eq!(s.user_limits("erin").await.unwrap(), None);
    let l = LimitOverrides { turns_per_minute: Some(5.0), open_streams: Some(2), ..Default::default() };
    s.set_user_limits("erin", Some(&l)).await.unwrap();
    assert_eq!(s.user_limits("erin").await.unwrap(), Some(l));
    s.set_user_limits("erin", None).await.unwrap();
    assert_eq!(s.user_limits("erin").await.unwrap(), None);

    // Per-key overrides: only a prefix naming exactly one live key changes anything.
    s.add_key("hk1", "bk-k1aaaa", "erin", "batch").await.unwrap();
    s.add_key("hk2", "bk-k1bbbb", "erin", "laptop").await.unwrap();
    let k = LimitOverrides { output_tokens_per_hour: Some(1e6), ..Default::default() };
    assert_eq!(s.set_key_limits("bk-k1", Some(&k)).await.unwrap(), 0, "an ambiguous prefix changes nothing");
    assert_eq!(s.key_limits("hk1").await.unwrap(), None);
    assert_eq!(s.set_key_limits("bk-k1a", Some(&k)).await.unwrap(), 1);
    assert_eq!(s.set_key_limits("bk-k1a", Some(&k)).await.unwrap(), 1, "setting again replaces");
    assert_eq!(s.key_limits("hk1").await.unwrap(), Some(k.clone()));
    assert_eq!(s.key_limits("hk2").await.unwrap(), None);
    let listed = s.list_keys().await.unwrap();
    assert_eq!(listed.iter().find(|i| i.prefix == "bk-k1aaaa").unwrap().limits, Some(k));
    assert_eq!(listed.iter().find(|i| i.prefix == "bk-k1bbbb").unwrap().limits, None);
    assert_eq!(s.set_key_limits("bk-k1a", None).await.unwrap(), 1);
    assert_eq!(s.key_limits("hk1").await.unwrap(), None);
    assert_eq!(s.revoke_keys("bk-k1b").await.unwrap(), 1);
    assert_eq!(s.set_key_limits("bk-k1b", Some(&LimitOverrides::default())).await.unwrap(), 0, "a revoked key gets no limits");
}

async fn keys(s: &dyn ConversationStore) {
    s.add_key("h1", "bk-aaaa", "alice", "laptop").await.unwrap();
    s.add_key("h1", "bk-aaaa", "alice", "laptop").await.unwrap();
    s.add_key("h2", "bk-bbbb", "bob", "").await.unwrap();
    assert_eq!(s.user_for_key("h1").await.unwrap().as_deref(), Some("alice"));
    assert_eq!(s.user_for_key("nope").await.unwrap(), None);
    assert_eq!(s.list_keys().await.unwrap().len(), 2);
    assert_eq!(s.revoke_keys("bk-aa").await.unwrap(), 1);
    assert_eq!(s.user_for_key("h1").await.unwrap(), None, "a revoked key must not authenticate");
    assert_eq!(s.user_for_key("h2").await.unwrap().as_deref(), Some("bob"));
    assert!(s.list_keys().await.unwrap().iter().any(|k| k.prefix == "bk-aaaa" && k.revoked));
}

async fn conversations_are_owner_scoped(s: &dyn ConversationStore) {
    s.create_conversation(&conv("c-own", "alice", now_unix())).await.unwrap();
    assert!(s.get_conversation("alice", "c-own").await.unwrap().is_some());
    assert!(s.get_conversation("bob", "c-own").await.unwrap().is_none(), "other user's conversation must be invisible");
    assert!(!s.delete_conversation("bob", "c-own", 0).await.unwrap(), "other user must not delete");
    assert!(s.list_conversations("alice").await.unwrap().iter().any(|c| c.id == "c-own"));
    assert!(s.list_conversations("bob").await.unwrap().is_empty());
    s.set_summary("c-own", "they talked", None).await.unwrap();
    assert_eq!(s.get_conversation("alice", "c-own").await.unwrap().unwrap().summary.as_deref(), Some("they talked"));
    assert_eq!(s.summary_through("c-own", 0).await.unwrap(), None, "a summary without its range is never reused");
    s.set_summary("c-own", "they talked more", Some(3)).await.unwrap();
    assert_eq!(s.summary_through("c-own", 3).await.unwrap().as_deref(), Some("they talked more"));
    assert_eq!(s.summary_through("c-own", 4).await.unwrap(), None, "only the same boundary reuses it");
    assert_eq!(s.summary_through("c-missing", 3).await.unwrap(), None);
}

async fn turns_are_idempotent_and_exact(s: &dyn ConversationStore) {
    s.create_conversation(&conv("c-turns", "alice", now_unix())).await.unwrap();
    let mut t = turn("c-turns", "t1", 0, "hash-a");
    t.metadata.insert("client".into(), "test".into());
    assert!(matches!(s.begin_turn(&t).await.unwrap(), BeginTurn::Created));
    match s.begin_turn(&t).await.unwrap() {
        BeginTurn::Existing(e) => assert_eq!(e.state, TurnState::Streaming),
        BeginTurn::Created | BeginTurn::Busy => panic!("a turn ID must be created once"),
    }
    let log: Vec<LogEntry> = (0..5).map(|i| LogEntry { index: i, text: format!("w{i} ") }).collect();
    s.append_log("c-turns", "t1", &log[..3]).await.unwrap();
    s.append_log("c-turns", "t1", &log[3..]).await.unwrap();
    assert_eq!(s.read_log("c-turns", "t1", 2).await.unwrap(), log[2..].to_vec());
    let end = TurnEnd {
        state: TurnState::Stopped,
        reply_text: "w0 w1 w2 w3 w4 ".into(),
        output_ids: vec![u32::MAX, 0, 7, 100_000],
        finish_reason: "cancelled".into(),
        prompt_tokens: 4,
        cached_tokens: 0,
        completion_tokens: 4,
    };
    s.finish_turn("c-turns", "t1", &end).await.unwrap();
    let got = s.get_turn("c-turns", "t1").await.unwrap().unwrap();
    assert_eq!(got.state, TurnState::Stopped);
    assert_eq!(got.output_ids, end.output_ids, "output token IDs must round-trip exactly");
    assert_eq!(got.prompt_ids, t.prompt_ids);
    assert_eq!(got.request_hash, "hash-a");
    assert_eq!(got.metadata, t.metadata, "a response's metadata must round-trip");
    // A failed turn is regenerated by a retry with the same body, not by another body.
    let t2 = turn("c-turns", "t2", 1, "hash-b");
    s.begin_turn(&t2).await.unwrap();
    let failed = TurnEnd {
        state: TurnState::Failed,
        reply_text: String::new(),
        output_ids: vec![],
        finish_reason: "x".into(),
        prompt_tokens: 0,
        cached_tokens: 0,
        completion_tokens: 0,
    };
    s.finish_turn("c-turns", "t2", &failed).await.unwrap();
    assert!(matches!(s.begin_turn(&turn("c-turns", "t2", 1, "other")).await.unwrap(), BeginTurn::Existing(_)));
    assert!(matches!(s.begin_turn(&t2).await.unwrap(), BeginTurn::Created));
    s.discard_turn("c-turns", "t2").await.unwrap();
    let turns = s.list_turns("c-turns").await.unwrap();
    assert_eq!(turns.iter().map(|t| t.turn_id.as_str()).collect::<Vec<_>>(), vec!["t1"]);
    s.begin_turn(&turn("c-turns", "t3", 1, "h")).await.unwrap();
    assert_eq!(s.fail_streaming_turns().await.unwrap(), 1);
    assert_eq!(s.get_turn("c-turns", "t3").await.unwrap().unwrap().state, TurnState::Failed);
}

/// The store's own admission guarantee (what keeps gateway replicas from forking a
/// conversation): one streaming turn per conversation, one turn per place.
async fn one_turn_admitted_at_a_time(s: &dyn ConversationStore) {
    s.create_conversation(&conv("c-adm", "alice", now_unix())).await.unwrap();
    s.create_conversation(&conv("c-adm2", "alice", now_unix())).await.unwrap();
    assert!(matches!(s.begin_turn(&turn("c-adm", "t1", 0, "h")).await.unwrap(), BeginTurn::Created));
    // A second turn while the first streams: refused, whatever place it asks for.
    assert!(matches!(s.begin_turn(&turn("c-adm", "t2", 1, "h")).await.unwrap(), BeginTurn::Busy));
    // Another conversation is not affected.
    assert!(matches!(s.begin_turn(&turn("c-adm2", "t2", 0, "h")).await.unwrap(), BeginTurn::Created));
    let done = done();
    s.finish_turn("c-adm", "t1", &done).await.unwrap();
    // Built on a view from before t1 (the same place): refused, never a fork.
    assert!(matches!(s.begin_turn(&turn("c-adm", "t2", 0, "h")).await.unwrap(), BeginTurn::Busy));
    assert!(matches!(s.begin_turn(&turn("c-adm", "t2", 1, "h")).await.unwrap(), BeginTurn::Created));
    let turns = s.list_turns("c-adm").await.unwrap();
    assert_eq!(turns.iter().map(|t| (t.turn_id.as_str(), t.seq)).collect::<Vec<_>>(), vec![("t1", 0), ("t2", 1)]);
    assert!(!s.turn_runs_elsewhere("c-adm", "t2").await.unwrap(), "a turn this store began does not run elsewhere");
    s.finish_turn("c-adm", "t2", &done).await.unwrap();
    s.finish_turn("c-adm2", "t2", &done).await.unwrap();
}

/// The Conversations API's metadata: stored with the conversation, replaced by its
/// owner only (another user's update changes nothing and says so).
async fn metadata_is_stored_and_owner_scoped(s: &dyn ConversationStore) {
    let mut c = conv("c-meta", "alice", now_unix());
    c.metadata.insert("topic".into(), "demo".into());
    s.create_conversation(&c).await.unwrap();
    let got = s.get_conversation("alice", "c-meta").await.unwrap().unwrap();
    assert_eq!(got.metadata, c.metadata, "metadata must round-trip");
    assert_eq!(s.list_conversations("alice").await.unwrap().iter().find(|x| x.id == "c-meta").unwrap().metadata, c.metadata);
    let mut attack = Map::new();
    attack.insert("topic".into(), "bob was here".into());
    assert!(!s.set_metadata("bob", "c-meta", &attack).await.unwrap(), "another user must not update metadata");
    assert_eq!(s.get_conversation("alice", "c-meta").await.unwrap().unwrap().metadata, c.metadata, "the victim's metadata is untouched");
    let mut m = Map::new();
    m.insert("k".into(), "v".into());
    assert!(s.set_metadata("alice", "c-meta", &m).await.unwrap());
    assert_eq!(s.get_conversation("alice", "c-meta").await.unwrap().unwrap().metadata, m);
    assert!(s.set_metadata("alice", "c-meta", &Map::new()).await.unwrap());
    assert!(s.get_conversation("alice", "c-meta").await.unwrap().unwrap().metadata.is_empty());
    assert!(!s.set_metadata("alice", "c-missing", &m).await.unwrap());
}

/// `replace_turns`: only the owner rewrites history, never over a streaming turn or a
/// turn admitted after the caller read the conversation; a rewrite that asks for it
/// leaves a tombstone (the nodes' KV of the old history is evicted) and keeps the
/// conversation.
async fn history_rewrites_are_owned_and_guarded(s: &dyn ConversationStore) {
    s.create_conversation(&conv("c-hist", "alice", now_unix())).await.unwrap();
    let item = |id: &str, seq: i64, reason: &str| Turn {
        state: TurnState::Done,
        finish_reason: Some(reason.into()),
        reply_text: if reason == ITEM_USER { String::new() } else { "r".into() },
        output_ids: if reason == ITEM_USER { vec![] } else { vec![9, 9] },
        ..turn("c-hist", id, seq, "")
    };
    let rows = [item("i0", 0, ITEM_PAIR), item("i1", 1, ITEM_USER)];
    assert_eq!(s.replace_turns("bob", "c-hist", None, 0, &rows, None).await.unwrap(), Replaced::NotFound, "another user must not add turns");
    assert!(s.list_turns("c-hist").await.unwrap().is_empty());
    assert_eq!(s.replace_turns("alice", "c-hist", Some(3), 0, &rows, None).await.unwrap(), Replaced::Busy, "a stale view is refused");
    assert_eq!(s.replace_turns("alice", "c-hist", None, 0, &rows, None).await.unwrap(), Replaced::Done);
    // A summary covering only place 0 survives a rewrite from place 1; one covering
    // place 1 is dropped by it (below).
    s.set_summary("c-hist", "up to i0", Some(0)).await.unwrap();
    let got = s.list_turns("c-hist").await.unwrap();
    assert_eq!(got, rows.to_vec(), "rows are stored exactly as given");
    assert!(got[0].added_as_items() && got[0].has_user_message() && got[0].has_reply());
    assert!(got[1].has_user_message() && !got[1].has_reply());
    // A turn streaming blocks a rewrite; once it is done, a rewrite from its place
    // replaces it and what follows, with a tombstone in the same transaction.
    assert!(matches!(s.begin_turn(&turn("c-hist", "t2", 2, "h")).await.unwrap(), BeginTurn::Created));
    assert_eq!(s.replace_turns("alice", "c-hist", Some(2), 1, &rows[..1], Some(0)).await.unwrap(), Replaced::Busy);
    assert_eq!(s.summary_through("c-hist", 0).await.unwrap().as_deref(), Some("up to i0"), "a refused rewrite keeps the summary");
    s.finish_turn("c-hist", "t2", &done()).await.unwrap();
    let before = s.count_tombstones().await.unwrap();
    let shorter = [item("i1b", 1, ITEM_ASSISTANT)];
    assert_eq!(s.replace_turns("alice", "c-hist", Some(2), 1, &shorter, Some(0)).await.unwrap(), Replaced::Done);
    let got = s.list_turns("c-hist").await.unwrap();
    assert_eq!(got.iter().map(|t| t.turn_id.as_str()).collect::<Vec<_>>(), ["i0", "i1b"]);
    assert!(!got[1].has_user_message() && got[1].has_reply());
    assert_eq!(s.count_tombstones().await.unwrap(), before + 1, "the old history's KV must be evicted");
    assert!(s.get_conversation("alice", "c-hist").await.unwrap().is_some(), "a rewrite keeps the conversation");
    assert_eq!(s.summary_through("c-hist", 0).await.unwrap().as_deref(), Some("up to i0"), "a rewrite after its range keeps it");
    s.set_summary("c-hist", "up to i1b", Some(1)).await.unwrap();
    assert_eq!(s.replace_turns("alice", "c-hist", Some(1), 1, &shorter, None).await.unwrap(), Replaced::Done);
    assert_eq!(s.summary_through("c-hist", 1).await.unwrap(), None, "a rewrite inside its range drops it");
    assert_eq!(s.get_conversation("alice", "c-hist").await.unwrap().unwrap().summary, None, "and its text");
    assert!(s.clear_tombstone("c-hist").await.unwrap());
}

async fn delete_leaves_no_row(s: &dyn ConversationStore) {
    s.create_conversation(&conv("c-del", "alice", now_unix())).await.unwrap();
    s.begin_turn(&turn("c-del", "t1", 0, "h")).await.unwrap();
    s.append_log("c-del", "t1", &[LogEntry { index: 0, text: "x".into() }]).await.unwrap();
    assert!(s.delete_conversation("alice", "c-del", 0).await.unwrap());
    assert!(s.get_conversation("alice", "c-del").await.unwrap().is_none());
    assert!(s.list_turns("c-del").await.unwrap().is_empty(), "turns must go with the conversation");
    assert!(s.read_log("c-del", "t1", 0).await.unwrap().is_empty(), "the token log must go with the conversation");
    // Finishing a turn of a deleted conversation stores nothing.
    let end = done();
    s.finish_turn("c-del", "t1", &end).await.unwrap();
    assert!(s.get_turn("c-del", "t1").await.unwrap().is_none());
}

async fn retention(s: &dyn ConversationStore) {
    let old = now_unix() - 40 * 86_400;
    s.create_conversation(&conv("c-old", "carol", old)).await.unwrap();
    s.create_conversation(&conv("c-new", "carol", now_unix())).await.unwrap();
    let gone = s.delete_older_than(now_unix() - 30 * 86_400).await.unwrap();
    assert_eq!(gone, vec!["c-old".to_string()]);
    assert!(s.get_conversation("carol", "c-new").await.unwrap().is_some());
}

/// Tombstones are left by every delete (and only by a delete that deleted something),
/// come due in order, record attempts and owed nodes, and clear.
async fn tombstones(s: &dyn ConversationStore) {
    // Left by the earlier checks: c-del (delete) and c-old (retention); none for c-own.
    let all = s.due_tombstones(i64::MAX, 100).await.unwrap();
    let ids: Vec<&str> = all.iter().map(|t| t.conversation.as_str()).collect();
    assert_eq!(ids.iter().filter(|i| **i == "c-del" || **i == "c-old").count(), 2, "{ids:?}");
    assert!(!ids.contains(&"c-own"), "a refused delete leaves no tombstone");
    for t in &all {
        assert!(s.clear_tombstone(&t.conversation).await.unwrap());
    }
    assert_eq!(s.count_tombstones().await.unwrap(), 0);
    assert!(!s.clear_tombstone("c-del").await.unwrap());

    let now = now_unix_ms();
    s.create_conversation(&conv("c-t1", "erin", now_unix())).await.unwrap();
    s.create_conversation(&conv("c-t2", "erin", now_unix())).await.unwrap();
    assert!(s.delete_conversation("erin", "c-t1", now + 1_000).await.unwrap());
    assert!(s.delete_conversation("erin", "c-t2", now + 500).await.unwrap());
    assert_eq!(s.count_tombstones().await.unwrap(), 2);
    assert!(s.due_tombstones(now, 10).await.unwrap().is_empty(), "not due before its first retry");
    let due = s.due_tombstones(now + 2_000, 10).await.unwrap();
    assert_eq!(due.iter().map(|t| t.conversation.as_str()).collect::<Vec<_>>(), vec!["c-t2", "c-t1"], "oldest due first");
    assert_eq!(due[0].attempts, 0);
    assert!(due[0].owed.is_empty());
    assert!(due[0].created_at >= now_unix() - 5);
    assert_eq!(s.due_tombstones(now + 2_000, 1).await.unwrap().len(), 1, "limit");

    let owed = vec!["decode-0".to_string(), "prefill-1".to_string()];
    s.tombstone_attempted("c-t2", 3, now + 60_000, &owed).await.unwrap();
    let due = s.due_tombstones(now + 2_000, 10).await.unwrap();
    assert_eq!(due.iter().map(|t| t.conversation.as_str()).collect::<Vec<_>>(), vec!["c-t1"]);
    let later = s.due_tombstones(now + 60_000, 10).await.unwrap();
    let t2 = later.iter().find(|t| t.conversation == "c-t2").unwrap();
    assert_eq!((t2.attempts, t2.next_attempt_ms, &t2.owed), (3, now + 60_000, &owed));
    s.tombstone_attempted("nope", 1, now, &[]).await.unwrap();

    assert!(s.clear_tombstone("c-t1").await.unwrap());
    assert!(s.clear_tombstone("c-t2").await.unwrap());
    assert_eq!(s.count_tombstones().await.unwrap(), 0);
    // The tombstone holds the ID only: the conversation's rows are gone at once.
    assert!(s.get_conversation("erin", "c-t1").await.unwrap().is_none());
}

async fn metering(s: &dyn ConversationStore) {
    let u = UsageCounts { requests: 1, prompt_tokens: 10, cached_tokens: 4, completion_tokens: 3 };
    s.add_usage("dave", u).await.unwrap();
    s.add_usage("dave", u).await.unwrap();
    assert_eq!(s.usage("dave").await.unwrap(), UsageCounts { requests: 2, prompt_tokens: 20, cached_tokens: 8, completion_tokens: 6 });
}
