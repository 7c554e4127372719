//! The writes that store an object: create, update (PUT) and patch, with what every one of
//! them goes through on the way in: defaulting and validation, fields of disabled features
//! dropped, the resourceVersion check.
//!
//! Each runs under the store's write lock from reading the current object to storing the
//! new one (see `handlers.rs` for why a write runs in a task of its own).

use http::StatusCode;
use serde_json::Value;

use super::App;
use super::objects::{self, meta_str};
use super::patch::{self, PatchKind};
use super::request::{Params, Reply, Target, Write, current_or_404, dry_run, parse_body, part};
use super::resources::Kind;
use super::status::ApiError;

pub(super) fn create(app: &App, write: &Write) -> Reply {
    let Write { target, params, .. } = write;
    let object = parse_body(&write.content_type, &write.body)?;
    let object = objects::prepare_create(target.kind, object, target.namespace.as_deref())?;
    let name = meta_str(&object, "name").unwrap_or("").to_owned();
    let key = (target.namespace.clone().unwrap_or_default(), name.clone());
    app.store.write(|store| {
        if store.get(target.kind, &key).is_some() {
            return Err(ApiError::already_exists(target.kind.plural(), &name));
        }
        if dry_run(params) {
            return Ok((StatusCode::CREATED, object));
        }
        Ok((StatusCode::CREATED, store.create(target.kind, key, object)))
    })
}

/// Shared by update and patch: store `new` over the current object, unless nothing changed.
fn store_update(
    store: &mut super::store::Inner,
    target: &Target,
    current: &Value,
    new: Value,
    params: &Params,
) -> Reply {
    let prepared = objects::prepare_update(target.kind, current, new, part(target))?;
    if &prepared == current || dry_run(params) {
        return Ok((StatusCode::OK, prepared));
    }
    let finished = prepared.pointer("/metadata/deletionTimestamp").is_some()
        && !objects::has_finalizers(&prepared)
        && target.kind == Kind::Pod
        && objects::has_finalizers(current);
    let stored = store.update(target.kind, target.key(), prepared);
    if finished {
        // The last finalizer is gone from an object being deleted: it goes now.
        store.delete(target.kind, &target.key());
    }
    Ok((StatusCode::OK, stored))
}

pub(super) fn update(app: &App, write: &Write) -> Reply {
    let Write { target, params, .. } = write;
    let new = parse_body(&write.content_type, &write.body)?;
    let body_name = meta_str(&new, "name").unwrap_or("");
    if body_name != target.name() {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({})",
            target.name()
        )));
    }
    app.store.write(|store| {
        let current = current_or_404(store, target)?.clone();
        let body_rv = meta_str(&new, "resourceVersion").unwrap_or("");
        if !body_rv.is_empty() && Some(body_rv) != meta_str(&current, "resourceVersion") {
            return Err(ApiError::stale(target.kind.plural(), target.name()));
        }
        store_update(store, target, &current, new, params)
    })
}

pub(super) fn patch_object(app: &App, write: &Write) -> Reply {
    let Write { target, params, .. } = write;
    let kind = PatchKind::from_content_type(&write.content_type)?;
    app.store.write(|store| {
        let current = current_or_404(store, target)?.clone();
        let patched = patch::apply(kind, &current, &write.body)?;
        if patched.pointer("/metadata/resourceVersion")
            != current.pointer("/metadata/resourceVersion")
        {
            return Err(ApiError::stale(target.kind.plural(), target.name()));
        }
        if meta_str(&patched, "name") != Some(target.name()) {
            return Err(ApiError::bad_request(
                "a patch may not change metadata.name",
            ));
        }
        store_update(store, target, &current, patched, params)
    })
}
