//! Whether this task may use the registered tool servers its definition names, by each server's
//! scope in the operator's registry (`tools::server_scope`): the task's topic, and, when a
//! scope lists processes, the process definition key of its instance as the engine names it
//! (`GET /v1/processes/instances/{id}`, the key on Abada 0.11). Checked when an attempt starts,
//! on the definition the run uses, before any model or tool call: a server outside its scope is
//! an incident naming the server and the scope, and its credential is never asked for.

use super::definition::AgentDefinition;
use super::scope::{Scope, Step, incident};
use crate::engine::EngineError;
use crate::handler::TaskError;
use crate::tools::server_scope::TaskOrigin;

const REFUSED: &str = "a tool server of the agent definition cannot be used";

/// `Ok` when every registered server `def` names admits this task.
pub(super) async fn check(scope: Scope<'_>, def: &AgentDefinition) -> Step {
    let Some(registry) = scope.rt.tool_registry.as_deref() else {
        return Ok(());
    };
    let process = if registry.scope_lists_processes(&def.tool_servers) {
        process_key(scope).await?
    } else {
        None
    };
    let origin = TaskOrigin {
        topic: &scope.task.topic,
        process: process.as_deref(),
    };
    registry
        .check_scope(&def.tool_servers, origin)
        .map_err(|e| incident(REFUSED, e.to_string()))
}

/// The process key of the task's instance; `None` for a task of no instance. A refused or
/// unusable read is an incident naming what the worker's identity needs; a transient one a
/// technical failure (retried).
async fn process_key(scope: Scope<'_>) -> Step<Option<String>> {
    let Some(instance) = scope.task.process_instance_id.as_deref() else {
        return Ok(None);
    };
    match scope.ctx.process_instance(instance).await {
        Ok(read) => Ok(Some(read.process_definition_id)),
        Err(TaskError::Engine(
            e @ (EngineError::AccessDenied { .. }
            | EngineError::NotFound { .. }
            | EngineError::MalformedResponse { .. }
            | EngineError::TooLarge { .. }),
        )) => Err(incident(
            REFUSED,
            format!(
                "a tool server it names is scoped to processes in ABADA_AGENT_TOOLS_FILE, and the process of instance {instance:?} cannot be read to check it ({e}); nothing was sent to any model or tool. Grant the worker's identity process:read"
            ),
        )),
        Err(e) => Err(scope.call_failed(
            e,
            &format!("cannot read process instance {instance:?} to check the tool servers' scope"),
        )),
    }
}
