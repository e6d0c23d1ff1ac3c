//! OpenAI's Conversations API (metadata and items) over HTTP, as attacks see it: Alice
//! makes a conversation with metadata and items and a generated turn; Bob, with only his
//! own key and Alice's IDs, tries every call on it and gets the same 404 as for an ID
//! that does not exist, and Alice's conversation is unchanged afterwards. Then Alice
//! deletes an item: it is gone, the rest keep their IDs, the conversation still answers
//! on the rebuilt history, and the old history's KV was evicted.

use crate::common;

use baton_api_gateway::client::{Client, Method, StatusCode};
use serde_json::{json, Value};

async fn call(c: &Client, method: Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
    c.json(method, path, body.as_ref()).await.unwrap()
}

fn item_ids(list: &Value) -> Vec<String> {
    list["data"].as_array().unwrap().iter().map(|i| i["id"].as_str().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_users_conversation_items_are_not_found_and_untouched() {
    let Some(s) = common::start(&[]).await else { return };
    let (alice, bob) = (s.client(), s.client2());
    let (st, conv) = call(
        &alice,
        Method::POST,
        "/v1/conversations",
        Some(json!({"metadata": {"topic": "secret"}, "items": [{"role": "user", "content": "My PIN is 4321."}, {"role": "assistant", "content": "Noted."}]})),
    )
    .await;
    assert_eq!(st, StatusCode::CREATED, "{conv}");
    let id = conv["id"].as_str().unwrap().to_string();
    let (st, r) = call(&alice, Method::POST, "/v1/responses", Some(json!({"input": "Say ok.", "conversation": id, "max_output_tokens": 4, "temperature": 0}))).await;
    assert_eq!(st, StatusCode::OK, "{r}");
    let (_, before) = call(&alice, Method::GET, &format!("/v1/conversations/{id}/items?order=asc"), None).await;
    let ids = item_ids(&before);
    assert_eq!(ids.len(), 4, "{before}");
    assert_eq!(before["data"][0]["content"][0]["text"], "My PIN is 4321.");

    // Bob, with Alice's IDs: every call is a 404 that says nothing more than for an unknown ID.
    let unknown = "conv-0000000000000000";
    for (method, path, body) in [
        (Method::GET, format!("/v1/conversations/{id}"), None),
        (Method::POST, format!("/v1/conversations/{id}"), Some(json!({"metadata": {"topic": "bob"}}))),
        (Method::GET, format!("/v1/conversations/{id}/items"), None),
        (Method::POST, format!("/v1/conversations/{id}/items"), Some(json!({"items": [{"role": "user", "content": "injected"}]}))),
        (Method::GET, format!("/v1/conversations/{id}/items/{}", ids[0]), None),
        (Method::DELETE, format!("/v1/conversations/{id}/items/{}", ids[0]), None),
        (Method::DELETE, format!("/v1/conversations/{id}"), None),
    ] {
        let (st, v) = call(&bob, method.clone(), &path, body.clone()).await;
        assert_eq!(st, StatusCode::NOT_FOUND, "bob {method} {path}: {v}");
        assert!(!v.to_string().contains("4321") && !v.to_string().contains("secret"), "{v}");
        let (st_unknown, v_unknown) = call(&bob, method.clone(), &path.replace(&id, unknown), body).await;
        assert_eq!(st_unknown, StatusCode::NOT_FOUND, "{v_unknown}");
        assert_eq!(v["error"]["type"], v_unknown["error"]["type"], "the same error as for an unknown ID");
    }
    let (_, after) = call(&alice, Method::GET, &format!("/v1/conversations/{id}/items?order=asc"), None).await;
    assert_eq!(after, before, "Bob changed Alice's items");
    let (_, c) = call(&alice, Method::GET, &format!("/v1/conversations/{id}"), None).await;
    assert_eq!(c["metadata"], json!({"topic": "secret"}), "Bob changed Alice's metadata");

    // Alice deletes the assistant item: gone, the others keep their IDs, and the
    // conversation answers again on the rebuilt history (its old KV evicted).
    let (st, v) = call(&alice, Method::DELETE, &format!("/v1/conversations/{id}/items/{}", ids[1]), None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!((v["id"].as_str(), v["kv_evicted"].as_bool()), (Some(id.as_str()), Some(true)), "{v}");
    let (_, left) = call(&alice, Method::GET, &format!("/v1/conversations/{id}/items?order=asc"), None).await;
    assert_eq!(item_ids(&left), vec![ids[0].clone(), ids[2].clone(), ids[3].clone()]);
    let (st, r2) = call(&alice, Method::POST, "/v1/responses", Some(json!({"input": "Again.", "conversation": id, "max_output_tokens": 4, "temperature": 0}))).await;
    assert_eq!(st, StatusCode::OK, "{r2}");
    let (st, _) = call(&alice, Method::GET, &format!("/v1/conversations/{id}/items/{}", ids[1]), None).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
}
