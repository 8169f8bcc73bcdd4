//! An async agent loop that crashes and resumes from its stored run.
//!
//! The agent reads a conversation, asks for tool calls, waits on an
//! approval, and "crashes" (every handle is dropped) while a tool call is
//! still pending. A new process — here, a new store handle — reads the run
//! back and resumes exactly where it stopped: the message cursor, the
//! pending tool calls and the approval it was held on are all in the record.
//!
//! Run it with `cargo run --example async_agent --features async`.

use agentstate::{
    Approval, AsyncStore, RunKey, RunRecord, RunState, SessionKey, SessionRecord, StateDelta,
    StateError, ToolCall, Usage,
};

/// The conversation the agent works through; `messages_read` indexes it.
const MESSAGES: [&str; 6] = [
    "user: find me a flight to Lisbon next Friday",
    "tool(search_flights): TP1351 dep 09:40, 180 EUR",
    "tool(seat_map): 12A free",
    "user: book it if it is under 200 EUR",
    "approval(approve-1): granted",
    "tool(book_flight): confirmed, PNR Q7X2LM",
];

/// What one model call costs, as a patch (amounts only move through patches).
fn spend(messages: u64) -> StateDelta {
    StateDelta {
        usage: Usage {
            input_tokens: 1_200,
            output_tokens: 180,
        },
        cost_micros: 4_150,
        iterations: 1,
        messages_read: messages,
    }
}

fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        id: id.into(),
        name: name.into(),
        arguments: arguments.into(),
    }
}

/// Re-reads the run, applies `change`, and writes it back at the version it
/// read; on a `Conflict` (another writer moved the run) it reads again and
/// decides again.
async fn update(
    store: &AsyncStore,
    key: &RunKey,
    change: impl Fn(&mut RunRecord),
) -> agentstate::Result<RunRecord> {
    loop {
        let mut run = store
            .get_run(key)
            .await?
            .ok_or_else(|| StateError::Invalid {
                what: "run vanished".into(),
            })?;
        change(&mut run);
        match store.put_run(run).await {
            Err(StateError::Conflict { .. }) => continue,
            other => return other,
        }
    }
}

/// The first life of the agent: it gets as far as an approval and dies.
async fn first_life(store: AsyncStore, key: &RunKey) -> agentstate::Result<()> {
    let mut run = RunRecord::new(key.clone(), "travel-agent").with_session("trip-1");
    run.state = RunState::Running;
    store.put_run(run).await?;
    println!(
        "[life 1] created {}/{} for session trip-1",
        key.tenant, key.run_id
    );

    // Turn 1: read the user's message, ask for a flight search.
    store.patch_run(key, spend(1)).await?;
    let run = update(&store, key, |r| {
        r.pending_tool_calls = vec![call(
            "call-1",
            "search_flights",
            r#"{"to":"LIS","date":"next friday"}"#,
        )];
    })
    .await?;
    println!(
        "[life 1] asked for search_flights; mid_tool_call = {}",
        run.mid_tool_call()
    );

    // The search answers: the call is done, its result consumed.
    store.patch_run(key, spend(1)).await?;
    let run = update(&store, key, |r| {
        r.pending_tool_calls.clear();
        r.pending_tool_calls
            .push(call("call-2", "seat_map", r#"{"flight":"TP1351"}"#));
    })
    .await?;
    println!(
        "[life 1] search done; asked for seat_map (version {})",
        run.version
    );

    // The seat map answers and the user says to book; booking needs a
    // human's approval. The run stops with the booking call pending and
    // the approval open.
    store.patch_run(key, spend(2)).await?;
    let run = update(&store, key, |r| {
        r.state = RunState::AwaitingApproval;
        r.pending_tool_calls = vec![call(
            "call-3",
            "book_flight",
            r#"{"flight":"TP1351","seat":"12A","card_token":"tok_live_51HqLyjWDarjtT1zdp7dc"}"#,
        )];
        r.approval = Some(Approval {
            id: "approve-1".into(),
            prompt: "Book TP1351 seat 12A for 180 EUR?".into(),
        });
    })
    .await?;
    let approval = run.approval.as_ref().map(|a| a.id.as_str()).unwrap_or("-");
    println!(
        "[life 1] waiting on approval {approval} with book_flight pending (version {})",
        run.version
    );
    println!("[life 1] *crash*: the process dies here; every handle is dropped");
    // No graceful close: the store is simply dropped, as a dying process
    // would leave it. Everything acknowledged above is already on disk.
    drop(store);
    Ok(())
}

/// The second life: it knows only the run's key, and resumes from the record.
async fn second_life(store: AsyncStore, key: &RunKey) -> agentstate::Result<()> {
    let run = store
        .get_run(key)
        .await?
        .ok_or_else(|| StateError::Invalid {
            what: "run lost".into(),
        })?;
    println!();
    println!(
        "[life 2] resumed {}/{} at version {} ({})",
        key.tenant,
        key.run_id,
        run.version,
        run.state.as_str()
    );
    let next = MESSAGES
        .get(run.messages_read as usize)
        .copied()
        .unwrap_or("(none)");
    println!(
        "[life 2]   message cursor: {} of {} read; next: {next:?}",
        run.messages_read,
        MESSAGES.len()
    );
    println!("[life 2]   mid_tool_call: {}", run.mid_tool_call());
    for c in &run.pending_tool_calls {
        println!(
            "[life 2]   pending tool call {} {}({})",
            c.id, c.name, c.arguments
        );
    }
    if let Some(a) = &run.approval {
        println!("[life 2]   held on approval {}: {}", a.id, a.prompt);
    }
    println!(
        "[life 2]   spent so far: {} iterations, {} + {} tokens, {} micros",
        run.iterations, run.usage.input_tokens, run.usage.output_tokens, run.cost_micros
    );

    // The approval arrives as the next message: run the pending call, read
    // its result, finish the run.
    assert!(
        run.approval.is_some() && run.mid_tool_call(),
        "the run resumes where it stopped"
    );
    store.patch_run(key, spend(1)).await?;
    update(&store, key, |r| {
        r.state = RunState::Running;
        r.approval = None;
    })
    .await?;
    println!(
        "[life 2] read {:?}; running {}",
        MESSAGES[run.messages_read as usize], run.pending_tool_calls[0].name
    );
    store.patch_run(key, spend(1)).await?;
    let run = update(&store, key, |r| {
        r.pending_tool_calls.clear();
        r.state = RunState::Completed;
    })
    .await?;
    println!(
        "[life 2] completed at version {}: {} messages read, {} iterations, {} micros spent",
        run.version, run.messages_read, run.iterations, run.cost_micros
    );
    Ok(())
}

#[tokio::main]
async fn main() -> agentstate::Result<()> {
    let dir = tempfile::tempdir().map_err(|e| StateError::Invalid {
        what: format!("temp dir: {e}"),
    })?;
    let path = dir.path().join("agent-state");
    let key = RunKey::new("acme", "run-2026-11-30-001");

    let store = AsyncStore::open(&path).await?;
    store
        .put_session(SessionRecord::new(SessionKey::new("acme", "trip-1")))
        .await?;
    first_life(store, &key).await?;

    // A new handle on the same directory: what a restarted worker opens.
    let store = AsyncStore::open(&path).await?;
    second_life(store.clone(), &key).await?;
    let report = store.verify().await?;
    println!(
        "verify: {} runs, {} sessions, problems: {}",
        report.runs,
        report.sessions,
        report.problems.len()
    );
    // A graceful end closes the store on the blocking pool (unlike the crash).
    store.close().await?;
    Ok(())
}
