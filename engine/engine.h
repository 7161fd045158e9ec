/*
 * engine.h - engine/ in one include: model files, tokenizer, chat templates, model and
 * weight versions, runtime, scheduler (each subfolder's own header says
 * what it offers, owns and may touch).
 */
#ifndef QL_ENGINE_H
#define QL_ENGINE_H

#include "model.h"
#include "modelfile.h"
#include "runtime.h"
#include "scheduler.h"
#include "template.h"
#include "tokenizer.h"

#include <stdio.h>

#endif
