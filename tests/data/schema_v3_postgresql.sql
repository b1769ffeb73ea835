-- the same version-3 database on PostgreSQL 15, as tpbench 11c6f80 wrote it (pg_dump --inserts --no-owner
-- --no-privileges, less its two psql-only \restrict lines): the four runs of schema_v3.sql
--
-- PostgreSQL database dump
--


-- Dumped from database version 15.18 (Debian 15.18-0+deb12u1)
-- Dumped by pg_dump version 15.18 (Debian 15.18-0+deb12u1)

SET statement_timeout = 0;
SET lock_timeout = 0;
SET idle_in_transaction_session_timeout = 0;
SET client_encoding = 'UTF8';
SET standard_conforming_strings = on;
SELECT pg_catalog.set_config('search_path', '', false);
SET check_function_bodies = false;
SET xmloption = content;
SET client_min_messages = warning;
SET row_security = off;

SET default_tablespace = '';

SET default_table_access_method = heap;

--
-- Name: comm; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.comm (
    id integer NOT NULL,
    run_id integer NOT NULL,
    rank integer NOT NULL,
    op character varying(32) NOT NULL,
    purpose character varying(32) NOT NULL,
    count integer NOT NULL,
    bytes bigint NOT NULL,
    time_s double precision,
    exposed_s double precision
);


--
-- Name: comm_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.comm_id_seq
    AS integer
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;


--
-- Name: comm_id_seq; Type: SEQUENCE OWNED BY; Schema: public; Owner: -
--

ALTER SEQUENCE public.comm_id_seq OWNED BY public.comm.id;


--
-- Name: measurements; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.measurements (
    id integer NOT NULL,
    run_id integer NOT NULL,
    rank integer NOT NULL,
    name character varying(64) NOT NULL,
    value double precision NOT NULL,
    unit character varying(16) NOT NULL,
    step integer
);


--
-- Name: measurements_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.measurements_id_seq
    AS integer
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;


--
-- Name: measurements_id_seq; Type: SEQUENCE OWNED BY; Schema: public; Owner: -
--

ALTER SEQUENCE public.measurements_id_seq OWNED BY public.measurements.id;


--
-- Name: meta; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.meta (
    key character varying(64) NOT NULL,
    value character varying(256) NOT NULL
);


--
-- Name: param_errors; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.param_errors (
    id integer NOT NULL,
    run_id integer NOT NULL,
    rank integer NOT NULL,
    name character varying(256) NOT NULL,
    semantics character varying(32) NOT NULL,
    shape character varying(64) NOT NULL,
    grad_mean_abs double precision NOT NULL,
    grad_max_abs double precision NOT NULL,
    grad_rel_l2 double precision NOT NULL
);


--
-- Name: param_errors_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.param_errors_id_seq
    AS integer
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;


--
-- Name: param_errors_id_seq; Type: SEQUENCE OWNED BY; Schema: public; Owner: -
--

ALTER SEQUENCE public.param_errors_id_seq OWNED BY public.param_errors.id;


--
-- Name: runs; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.runs (
    id integer NOT NULL,
    config_hash character varying(16) NOT NULL,
    config json NOT NULL,
    kind character varying(16) NOT NULL,
    mode character varying(32) NOT NULL,
    engine character varying(16) NOT NULL,
    tp integer NOT NULL,
    dp integer NOT NULL,
    sp boolean NOT NULL,
    vp boolean NOT NULL,
    layers integer NOT NULL,
    hidden integer NOT NULL,
    heads integer NOT NULL,
    kv_heads integer NOT NULL,
    vocab integer NOT NULL,
    seq integer NOT NULL,
    micro_batch integer NOT NULL,
    global_batch integer NOT NULL,
    batch_policy character varying(16) NOT NULL,
    dtype character varying(16) NOT NULL,
    "precision" character varying(16) NOT NULL,
    world_size integer NOT NULL,
    fault character varying(32) NOT NULL,
    sweep text NOT NULL,
    status character varying(16) NOT NULL,
    error text NOT NULL,
    failed_rank integer,
    started_at timestamp without time zone NOT NULL,
    ended_at timestamp without time zone NOT NULL,
    host character varying(256) NOT NULL,
    device character varying(16) NOT NULL,
    device_name character varying(256) NOT NULL,
    device_count integer NOT NULL,
    backend character varying(16) NOT NULL,
    torch_version character varying(64) NOT NULL,
    cuda_version character varying(32),
    git_commit character varying(64),
    git_dirty boolean,
    log_dir text,
    slurm_job_id character varying(32),
    nodes text,
    text text NOT NULL
);


--
-- Name: runs_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.runs_id_seq
    AS integer
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;


--
-- Name: runs_id_seq; Type: SEQUENCE OWNED BY; Schema: public; Owner: -
--

ALTER SEQUENCE public.runs_id_seq OWNED BY public.runs.id;


--
-- Name: comm id; Type: DEFAULT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.comm ALTER COLUMN id SET DEFAULT nextval('public.comm_id_seq'::regclass);


--
-- Name: measurements id; Type: DEFAULT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.measurements ALTER COLUMN id SET DEFAULT nextval('public.measurements_id_seq'::regclass);


--
-- Name: param_errors id; Type: DEFAULT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.param_errors ALTER COLUMN id SET DEFAULT nextval('public.param_errors_id_seq'::regclass);


--
-- Name: runs id; Type: DEFAULT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.runs ALTER COLUMN id SET DEFAULT nextval('public.runs_id_seq'::regclass);


--
-- Data for Name: comm; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.comm VALUES (1, 1, 0, 'all_reduce', 'activation', 8, 4096, 0.01, 0.005);
INSERT INTO public.comm VALUES (2, 1, 1, 'all_reduce', 'activation', 8, 8192, 0.01, 0.005);
INSERT INTO public.comm VALUES (3, 2, 0, 'all_reduce', 'activation', 8, 4096, 0.01, 0.005);
INSERT INTO public.comm VALUES (4, 2, 1, 'all_reduce', 'activation', 8, 8192, 0.01, 0.005);
INSERT INTO public.comm VALUES (5, 3, 0, 'all_reduce', 'activation', 8, 4096, 0.01, 0.005);
INSERT INTO public.comm VALUES (6, 3, 1, 'all_reduce', 'activation', 8, 8192, 0.01, 0.005);


--
-- Data for Name: measurements; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.measurements VALUES (1, 1, 0, 'peak_bytes', 1000, 'B', NULL);
INSERT INTO public.measurements VALUES (2, 1, 0, 'passed', 1, '', NULL);
INSERT INTO public.measurements VALUES (3, 1, 0, 'adamw_logits_max_abs', 1e-06, '', 1);
INSERT INTO public.measurements VALUES (4, 1, 1, 'peak_bytes', 1001, 'B', NULL);
INSERT INTO public.measurements VALUES (5, 1, 1, 'passed', 1, '', NULL);
INSERT INTO public.measurements VALUES (6, 1, 1, 'adamw_logits_max_abs', 1e-06, '', 1);
INSERT INTO public.measurements VALUES (7, 2, 0, 'peak_bytes', 2000, 'B', NULL);
INSERT INTO public.measurements VALUES (8, 2, 0, 'passed', 1, '', NULL);
INSERT INTO public.measurements VALUES (9, 2, 0, 'adamw_logits_max_abs', 1e-06, '', 1);
INSERT INTO public.measurements VALUES (10, 2, 1, 'peak_bytes', 2001, 'B', NULL);
INSERT INTO public.measurements VALUES (11, 2, 1, 'passed', 1, '', NULL);
INSERT INTO public.measurements VALUES (12, 2, 1, 'adamw_logits_max_abs', 1e-06, '', 1);
INSERT INTO public.measurements VALUES (13, 3, 0, 'peak_bytes', 3000, 'B', NULL);
INSERT INTO public.measurements VALUES (14, 3, 0, 'passed', 1, '', NULL);
INSERT INTO public.measurements VALUES (15, 3, 0, 'adamw_logits_max_abs', 1e-06, '', 1);
INSERT INTO public.measurements VALUES (16, 3, 1, 'peak_bytes', 3001, 'B', NULL);
INSERT INTO public.measurements VALUES (17, 3, 1, 'passed', 1, '', NULL);
INSERT INTO public.measurements VALUES (18, 3, 1, 'adamw_logits_max_abs', 1e-06, '', 1);


--
-- Data for Name: meta; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.meta VALUES ('app', 'tpbench');
INSERT INTO public.meta VALUES ('schema_version', '3');


--
-- Data for Name: param_errors; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.param_errors VALUES (1, 1, 0, 'model.norm.weight', 'replicated', '[64]', 1e-09, 2e-09, 3e-07);
INSERT INTO public.param_errors VALUES (2, 1, 1, 'model.norm.weight', 'replicated', '[64]', 1e-09, 2e-09, 3e-07);
INSERT INTO public.param_errors VALUES (3, 2, 0, 'model.norm.weight', 'replicated', '[64]', 1e-09, 2e-09, 3e-07);
INSERT INTO public.param_errors VALUES (4, 2, 1, 'model.norm.weight', 'replicated', '[64]', 1e-09, 2e-09, 3e-07);
INSERT INTO public.param_errors VALUES (5, 3, 0, 'model.norm.weight', 'replicated', '[64]', 1e-09, 2e-09, 3e-07);
INSERT INTO public.param_errors VALUES (6, 3, 1, 'model.norm.weight', 'replicated', '[64]', 1e-09, 2e-09, 3e-07);


--
-- Data for Name: runs; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.runs VALUES (1, '93fc32d94c9c44c8', '{"kind": "memory", "model": {"name": "tiny", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256, "intermediate_size": null, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "max_position_embeddings": 32768, "tie_word_embeddings": true, "flash_attn": true, "fused_swiglu": true, "lean_rmsnorm": true}, "parallel": {"tp": 2, "dp": 1, "sp": false, "vp": false, "engine": "megatron", "sp_regather": true, "sp_gather": "region", "vocab_pad_multiple": 1, "overlap": false, "ddp_bucket_mb": 25.0, "ddp_gradient_as_bucket_view": true}, "train": {"seq_len": 32, "micro_batch": 2, "global_batch": 4, "batch": "fixed_per_rank", "dtype": "float32", "precision": "pure", "loss": "cross_entropy", "keep_output": false, "recompute": "none", "lr": 0.001, "weight_decay": 0.0, "fused_optimizer": false, "compile": false, "steps": 5, "warmup": 2, "seed": 0}, "validate": {"steps": 20, "every": 5, "lr": 0.0005, "tol_fwd": 1e-05, "tol_loss": 1e-05, "tol_grad_rel": 1e-05, "tol_param": 0.001}, "launch": {"launcher": "local", "max_parallel": 4, "slurm": {"partition": "", "account": "", "time_min": 60, "gpus_per_node": 0, "cpus_per_rank": 1, "mem_gb": 0.0, "sbatch": [], "on_preempt": "requeue", "folder": "runs/slurm"}, "device": "cpu", "backend": "gloo", "nnodes": "1", "node_rank": 0, "nproc_per_node": null, "rdzv_backend": "c10d", "rdzv_endpoint": "", "rdzv_id": "tpbench", "collective_timeout_s": 300.0, "job_timeout_s": 3600.0, "memory_cap_mb": 0, "max_result_mb": 64.0, "emulate": "none", "emulate_rank": null, "emulate_gpu": "H100"}, "db": {"url": "sqlite:///runs/tpbench.db"}, "debug": {"skip_grad_sum": [], "overlap_fault": ""}, "fault": "", "sweep": "v3"}', 'memory', 'tp', 'megatron', 2, 1, false, false, 2, 64, 8, 4, 256, 32, 2, 4, 'fixed_per_rank', 'float32', 'pure', 2, '', 'v3', 'OK', '', NULL, '2026-12-01 10:00:00', '2026-12-01 10:00:07', 'node1', 'cpu', 'AMD EPYC 9B14', 2, 'gloo', '2.13.0', NULL, '11c6f80', false, NULL, NULL, NULL, 'table of rank 0');
INSERT INTO public.runs VALUES (2, '4db285eb7821b2d7', '{"kind": "memory", "model": {"name": "tiny", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256, "intermediate_size": null, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "max_position_embeddings": 32768, "tie_word_embeddings": true, "flash_attn": true, "fused_swiglu": true, "lean_rmsnorm": true}, "parallel": {"tp": 2, "dp": 1, "sp": false, "vp": false, "engine": "megatron", "sp_regather": true, "sp_gather": "region", "vocab_pad_multiple": 1, "overlap": false, "ddp_bucket_mb": 25.0, "ddp_gradient_as_bucket_view": true}, "train": {"seq_len": 32, "micro_batch": 2, "global_batch": 4, "batch": "fixed_per_rank", "dtype": "float32", "precision": "pure", "loss": "cross_entropy", "keep_output": false, "recompute": "none", "lr": 0.001, "weight_decay": 0.0, "fused_optimizer": false, "compile": false, "steps": 5, "warmup": 2, "seed": 0}, "validate": {"steps": 20, "every": 5, "lr": 0.0005, "tol_fwd": 1e-05, "tol_loss": 1e-05, "tol_grad_rel": 1e-05, "tol_param": 0.001}, "launch": {"launcher": "local", "max_parallel": 4, "slurm": {"partition": "", "account": "", "time_min": 60, "gpus_per_node": 0, "cpus_per_rank": 1, "mem_gb": 0.0, "sbatch": [], "on_preempt": "requeue", "folder": "runs/slurm"}, "device": "cuda", "backend": "nccl", "nnodes": "2", "node_rank": 0, "nproc_per_node": null, "rdzv_backend": "c10d", "rdzv_endpoint": "", "rdzv_id": "tpbench", "collective_timeout_s": 300.0, "job_timeout_s": 3600.0, "memory_cap_mb": 0, "max_result_mb": 64.0, "emulate": "none", "emulate_rank": null, "emulate_gpu": "H100"}, "db": {"url": "sqlite:///runs/tpbench.db"}, "debug": {"skip_grad_sum": [], "overlap_fault": ""}, "fault": "", "sweep": "v3"}', 'memory', 'tp', 'megatron', 2, 1, false, false, 2, 64, 8, 4, 256, 32, 2, 4, 'fixed_per_rank', 'float32', 'pure', 2, '', 'v3', 'OK', '', NULL, '2026-12-01 10:00:00', '2026-12-01 10:00:07', 'node1', 'cuda', 'NVIDIA A100-SXM4-80GB', 8, 'nccl', '2.13.0', '12.8', '11c6f80', false, NULL, NULL, NULL, 'table of rank 0');
INSERT INTO public.runs VALUES (3, '4458f1324f050aeb', '{"kind": "memory", "model": {"name": "tiny", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256, "intermediate_size": null, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "max_position_embeddings": 32768, "tie_word_embeddings": true, "flash_attn": true, "fused_swiglu": true, "lean_rmsnorm": true}, "parallel": {"tp": 2, "dp": 1, "sp": false, "vp": false, "engine": "megatron", "sp_regather": true, "sp_gather": "region", "vocab_pad_multiple": 1, "overlap": false, "ddp_bucket_mb": 25.0, "ddp_gradient_as_bucket_view": true}, "train": {"seq_len": 32, "micro_batch": 2, "global_batch": 4, "batch": "fixed_per_rank", "dtype": "float32", "precision": "pure", "loss": "cross_entropy", "keep_output": false, "recompute": "none", "lr": 0.001, "weight_decay": 0.0, "fused_optimizer": false, "compile": false, "steps": 5, "warmup": 2, "seed": 0}, "validate": {"steps": 20, "every": 5, "lr": 0.0005, "tol_fwd": 1e-05, "tol_loss": 1e-05, "tol_grad_rel": 1e-05, "tol_param": 0.001}, "launch": {"launcher": "local", "max_parallel": 4, "slurm": {"partition": "", "account": "", "time_min": 60, "gpus_per_node": 0, "cpus_per_rank": 1, "mem_gb": 0.0, "sbatch": [], "on_preempt": "requeue", "folder": "runs/slurm"}, "device": "cuda", "backend": "nccl", "nnodes": "1", "node_rank": 0, "nproc_per_node": null, "rdzv_backend": "c10d", "rdzv_endpoint": "", "rdzv_id": "tpbench", "collective_timeout_s": 300.0, "job_timeout_s": 3600.0, "memory_cap_mb": 0, "max_result_mb": 64.0, "emulate": "fake", "emulate_rank": null, "emulate_gpu": "H100"}, "db": {"url": "sqlite:///runs/tpbench.db"}, "debug": {"skip_grad_sum": [], "overlap_fault": ""}, "fault": "", "sweep": "v3"}', 'memory', 'tp', 'megatron', 2, 1, false, false, 2, 64, 8, 4, 256, 32, 2, 4, 'fixed_per_rank', 'float32', 'pure', 2, '', 'v3', 'OK', '', NULL, '2026-12-01 10:00:00', '2026-12-01 10:00:07', 'node1', 'cuda', 'H100 (emulated on AMD EPYC 9B14)', 2, 'fake', '2.13.0', '12.8', '11c6f80', false, NULL, NULL, NULL, 'table of rank 0');
INSERT INTO public.runs VALUES (4, 'c05a10d27d9e7faa', '{"kind": "validate", "model": {"name": "tiny", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256, "intermediate_size": null, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "max_position_embeddings": 32768, "tie_word_embeddings": true, "flash_attn": true, "fused_swiglu": true, "lean_rmsnorm": true}, "parallel": {"tp": 2, "dp": 1, "sp": false, "vp": false, "engine": "megatron", "sp_regather": true, "sp_gather": "region", "vocab_pad_multiple": 1, "overlap": false, "ddp_bucket_mb": 25.0, "ddp_gradient_as_bucket_view": true}, "train": {"seq_len": 32, "micro_batch": 2, "global_batch": 4, "batch": "fixed_per_rank", "dtype": "float32", "precision": "pure", "loss": "cross_entropy", "keep_output": false, "recompute": "none", "lr": 0.001, "weight_decay": 0.0, "fused_optimizer": false, "compile": false, "steps": 5, "warmup": 2, "seed": 0}, "validate": {"steps": 20, "every": 5, "lr": 0.0005, "tol_fwd": 1e-05, "tol_loss": 1e-05, "tol_grad_rel": 1e-05, "tol_param": 0.001}, "launch": {"launcher": "local", "max_parallel": 4, "slurm": {"partition": "", "account": "", "time_min": 60, "gpus_per_node": 0, "cpus_per_rank": 1, "mem_gb": 0.0, "sbatch": [], "on_preempt": "requeue", "folder": "runs/slurm"}, "device": "cpu", "backend": "gloo", "nnodes": "1", "node_rank": 0, "nproc_per_node": null, "rdzv_backend": "c10d", "rdzv_endpoint": "", "rdzv_id": "tpbench", "collective_timeout_s": 300.0, "job_timeout_s": 3600.0, "memory_cap_mb": 0, "max_result_mb": 64.0, "emulate": "none", "emulate_rank": null, "emulate_gpu": "H100"}, "db": {"url": "sqlite:///runs/tpbench.db"}, "debug": {"skip_grad_sum": [], "overlap_fault": ""}, "fault": "", "sweep": "v3"}', 'validate', 'tp', 'megatron', 2, 1, false, false, 2, 64, 8, 4, 256, 32, 2, 4, 'fixed_per_rank', 'float32', 'pure', 2, '', 'v3', 'FAILED', 'rank 1: RuntimeError: boom', 1, '2026-12-01 10:00:00', '2026-12-01 10:00:07', 'node1', 'cpu', 'AMD EPYC 9B14', 2, 'gloo', '2.13.0', NULL, '11c6f80', false, NULL, NULL, NULL, '');


--
-- Name: comm_id_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.comm_id_seq', 6, true);


--
-- Name: measurements_id_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.measurements_id_seq', 18, true);


--
-- Name: param_errors_id_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.param_errors_id_seq', 6, true);


--
-- Name: runs_id_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.runs_id_seq', 4, true);


--
-- Name: comm comm_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.comm
    ADD CONSTRAINT comm_pkey PRIMARY KEY (id);


--
-- Name: measurements measurements_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.measurements
    ADD CONSTRAINT measurements_pkey PRIMARY KEY (id);


--
-- Name: meta meta_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.meta
    ADD CONSTRAINT meta_pkey PRIMARY KEY (key);


--
-- Name: param_errors param_errors_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.param_errors
    ADD CONSTRAINT param_errors_pkey PRIMARY KEY (id);


--
-- Name: runs runs_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.runs
    ADD CONSTRAINT runs_pkey PRIMARY KEY (id);


--
-- Name: ix_comm_run_id; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_comm_run_id ON public.comm USING btree (run_id);


--
-- Name: ix_measurements_run_id; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_measurements_run_id ON public.measurements USING btree (run_id);


--
-- Name: ix_param_errors_run_id; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_param_errors_run_id ON public.param_errors USING btree (run_id);


--
-- Name: ix_runs_config_hash; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_runs_config_hash ON public.runs USING btree (config_hash);


--
-- Name: ix_runs_status; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ix_runs_status ON public.runs USING btree (status);


--
-- Name: comm comm_run_id_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.comm
    ADD CONSTRAINT comm_run_id_fkey FOREIGN KEY (run_id) REFERENCES public.runs(id);


--
-- Name: measurements measurements_run_id_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.measurements
    ADD CONSTRAINT measurements_run_id_fkey FOREIGN KEY (run_id) REFERENCES public.runs(id);


--
-- Name: param_errors param_errors_run_id_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.param_errors
    ADD CONSTRAINT param_errors_run_id_fkey FOREIGN KEY (run_id) REFERENCES public.runs(id);


--
-- PostgreSQL database dump complete
--


